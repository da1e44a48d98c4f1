"""The manual stays true to the code: the generated Config table, and every relative link.

No Ray, torch or network: the table is rebuilt from the source of ``tensorhub/config.py``
(:mod:`tensorhub._docgen`), links are checked against the files of the repository.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tensorhub import _docgen

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    doc.write_text(f"intro\n{_docgen.BEGIN}\nan outdated table\n{_docgen.END}\n")
    assert _docgen.main(["config", "--check", "--doc", str(doc)]) == 1
    assert _docgen.COMMAND in capsys.readouterr().err
    assert _docgen.main(["config", "--doc", str(doc)]) == 0
    assert _docgen.main(["config", "--check", "--doc", str(doc)]) == 0
    assert doc.read_text().startswith("intro\n") and "an outdated table" not in doc.read_text()


# ---------------------------------------------------------------------------- links

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*(?:<([^>\n]+)>|([^)\s]+))(?:\s+\"[^\"]*\")?\s*\)")


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Targets of inline Markdown links and images outside code, without URLs or bare anchors."""
    text = _CODE.sub("", _FENCE.sub("", text))
    out = []
    for bracketed, plain in _LINK.findall(text):
        target = bracketed or plain
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # https:, mailto:, ... and anchors inside the same file
        out.append(target)
    return out


def test_link_scanner_skips_code_urls_and_anchors():
    text = ("[a](docs/a.md#x) ![img](b.png) [u](https://x.org/y) [h](#here) `[c](code.md)`\n"
            "```\n[d](fenced.md)\n```\n[e](<e f.md>)")
    assert relative_links(text) == ["docs/a.md#x", "b.png", "e f.md"]


def test_docs_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    assert {"README.md", "concepts.md", "api.md", "configuration.md", "operations.md", "security.md",
            "limits.md", "integrations.md", "design.md"} <= names


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped
    (hyphens and underscores stay), spaces to hyphens, repeats numbered ``-1``, ``-2``."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_follow_github():
    text = "# A title\n## 1. The core's rules\n### Compiled-graph pipelines (`tensorhub.graphs`)\n## A title\n"
    assert anchors(text) == {"a-title", "1-the-cores-rules", "compiled-graph-pipelines-tensorhubgraphs", "a-title-1"}


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_existing_files(path):
    """Every relative link names an existing file; one into a Markdown file with ``#anchor``
    names one of its headings."""
    missing, dangling = [], []
    for target in relative_links(path.read_text()):
        file_part, _, anchor = target.partition("#")
        dest = path.parent / file_part
        if file_part and not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            dangling.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"
    assert not dangling, f"{path.relative_to(ROOT)} links to missing headings: {dangling}"


def test_same_file_anchors_exist():
    for path in _markdown_files():
        text = path.read_text()
        own = [t[1:] for t in re.findall(r"\]\((#[^)\s]+)\)", _CODE.sub("", _FENCE.sub("", text)))]
        assert set(own) <= anchors(text), f"{path.relative_to(ROOT)}: {sorted(set(own) - anchors(text))}"


def _headings(text: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", _FENCE.sub("", text), re.M)}


def test_package_citations_of_the_manual_name_existing_files_and_sections():
    """The package's docstrings and comments cite the manual as ``docs/<file>.md`` (with a
    section as ``docs/<file>.md, "<heading>"`` or ``docs/<file>.md ("<heading>")``): each file
    exists and each quoted heading starts one of its headings. README sections are not cited:
    the README is short and its sections moved into docs/ (a dozen docstrings pointed at them)."""
    cite = re.compile(r'docs/(\w+\.md)(?:,\s*|\s*\(\s*)?(?:"([^"]+)")?')
    bad = []
    for py in sorted((ROOT / "tensorhub").rglob("*.py")):
        text = py.read_text()
        where = py.relative_to(ROOT).as_posix()
        for m in re.finditer(r'README[,:]\s*"', text):
            bad.append(f"{where}: cites a README section: {text[m.start():m.start() + 40]!r}")
        for m in cite.finditer(text):
            doc = DOCS / m.group(1)
            if not doc.exists():
                bad.append(f"{where}: docs/{m.group(1)} does not exist")
            elif m.group(2) and not any(h.startswith(m.group(2)) for h in _headings(doc.read_text())):
                bad.append(f"{where}: docs/{m.group(1)} has no heading {m.group(2)!r}")
    assert not bad, bad
