"""The manual stays true to the code: the generated Config table.

No Ray, torch or network: the table is rebuilt from the source of ``tensorhub/config.py``
(:mod:`tensorhub._docgen`).
"""

from __future__ import annotations

import pathlib

import pytest

from tensorhub import _docgen

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_configuration_table_matches_config():
    source = _docgen.CONFIG_SOURCE.read_text()
    doc = _docgen.CONFIG_DOC.read_text()
    assert doc == _docgen.render(doc, _docgen.config_table(source)), (
        f"docs/configuration.md's table differs from tensorhub/config.py: run `{_docgen.COMMAND}`")


def test_configuration_table_lists_every_field_once():
    import dataclasses

    from tensorhub.config import Config

    fields = [f.name for f in _docgen.config_fields(_docgen.CONFIG_SOURCE.read_text())]
    assert fields == [f.name for f in dataclasses.fields(Config)]
    table = _docgen.CONFIG_DOC.read_text()
    for name in fields:
        assert table.count(f"| `{name}` |") == 1, name


def test_docgen_reads_types_defaults_and_first_sentences():
    source = '''
import dataclasses
class Config:
    a: int = 16 << 20
    """Largest unit (e.g. 2.5 MiB, see ``b``). Second sentence."""
    b: str = dataclasses.field(default="x", repr=False)
    """Uses :class:`~pkg.mod.Thing` and :mod:`pkg.mod`; a | b."""
    c: float = 0.5
    def method(self) -> None:
        pass
'''
    fields = _docgen.config_fields(source)
    assert [(f.name, f.type, f.default) for f in fields] == [
        ("a", "int", "`16 << 20` (16 MiB)"), ("b", "str", '`"x"`'), ("c", "float", "`0.5`")]
    assert _docgen.first_sentence(fields[0].doc) == "Largest unit (e.g. 2.5 MiB, see ``b``)."
    assert _docgen.to_markdown(fields[1].doc) == "Uses `Thing` and `pkg.mod`; a \\| b."
    assert fields[2].doc is None and _docgen.undocumented(source) == ["c"]
    table = _docgen.config_table(source)
    assert _docgen.NO_DOCSTRING in table.splitlines()[-1]
    with pytest.raises(ValueError):
        _docgen.render("no markers here", table)


def test_docgen_check_mode_says_which_command(tmp_path, capsys):
    doc = tmp_path / "configuration.md"
    doc.write_text(f"intro\n{_docgen.BEGIN}\nstale\n{_docgen.END}\n")
    assert _docgen.main(["config", "--check", "--doc", str(doc)]) == 1
    assert _docgen.COMMAND in capsys.readouterr().err
    assert _docgen.main(["config", "--doc", str(doc)]) == 0
    assert _docgen.main(["config", "--check", "--doc", str(doc)]) == 0
    assert doc.read_text().startswith("intro\n") and "stale" not in doc.read_text()
