"""Unit table, fingerprints and checksums of tensorhub.layout (pure, no NIXL)."""

import pytest
import torch

from tensorhub.errors import LayoutMismatch
from tensorhub.layout import Layout, Piece, TensorMeta, checksum_all, checksum_unit

KB = 1024


def _t(nbytes: int, dtype=torch.uint8) -> torch.Tensor:
    esize = torch.empty(0, dtype=dtype).element_size()
    return torch.zeros(nbytes // esize, dtype=dtype)


def _named(*sizes: int):
    return [(f"t{i}", _t(n)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    "sizes, unit, pack_below, expected",
    [
        # one tensor exactly one unit
        ((8 * KB,), 8 * KB, 0, [[(0, 0, 8 * KB)]]),
        # chunking: one byte over a unit boundary makes a 1-byte tail unit
        ((8 * KB + 1,), 8 * KB, 0, [[(0, 0, 8 * KB)], [(0, 8 * KB, 1)]]),
        ((24 * KB,), 8 * KB, 0, [[(0, 0, 8 * KB)], [(0, 8 * KB, 8 * KB)], [(0, 16 * KB, 8 * KB)]]),
        # tiny tensors pack together up to unit_bytes
        ((1 * KB, 2 * KB, 3 * KB), 8 * KB, 4 * KB, [[(0, 0, KB), (1, 0, 2 * KB), (2, 0, 3 * KB)]]),
        # a pack that would overflow unit_bytes starts a new unit
        ((3 * KB, 3 * KB, 3 * KB), 8 * KB, 4 * KB, [[(0, 0, 3 * KB), (1, 0, 3 * KB)], [(2, 0, 3 * KB)]]),
        # a large tensor breaks a run of tiny ones
        ((KB, 16 * KB, KB), 8 * KB, 4 * KB,
         [[(0, 0, KB)], [(1, 0, 8 * KB)], [(1, 8 * KB, 8 * KB)], [(2, 0, KB)]]),
        # threshold is min(pack_below, unit): pack_below > unit means tensors >= unit are chunked
        ((8 * KB, KB), 8 * KB, 1 << 30, [[(0, 0, 8 * KB)], [(1, 0, KB)]]),
        # exactly pack_below is not tiny
        ((4 * KB, 4 * KB), 8 * KB, 4 * KB, [[(0, 0, 4 * KB)], [(1, 0, 4 * KB)]]),
        # zero-size tensors get no pieces and do not break a pack
        ((KB, 0, KB), 8 * KB, 4 * KB, [[(0, 0, KB), (2, 0, KB)]]),
        ((0,), 8 * KB, 4 * KB, []),
    ],
)
def test_unit_table(sizes, unit, pack_below, expected):
    lay = Layout.build(_named(*sizes), unit, pack_below)
    assert [[tuple(p) for p in u] for u in lay.units] == expected
    assert lay.unit_count == len(expected)
    assert lay.total_bytes == sum(sizes)
    covered = sum(p.nbytes for u in lay.units for p in u)
    assert covered == sum(sizes)
    assert all(sum(p.nbytes for p in u) <= unit for u in lay.units)
    assert all(isinstance(p, Piece) for u in lay.units for p in u)


def test_metas_describe_tensors():
    lay = Layout.build({"a": torch.zeros(2, 3), "b": torch.zeros(5, dtype=torch.bfloat16)}, 4096, 0)
    assert lay.metas == (TensorMeta("a", "float32", (2, 3), 24), TensorMeta("b", "bfloat16", (5,), 10))


@pytest.mark.parametrize(
    "named, needle",
    [
        ([], "no tensors"),
        ([("a", torch.zeros(4)), ("a", torch.zeros(4))], "'a'"),
        ([("nc", torch.zeros(4, 4).t())], "'nc'"),
        ([("q", torch.zeros(4).to(torch.float32).to_sparse())], "'q'"),
        ([("x", [1, 2])], "'x'"),
    ],
)
def test_build_rejects_bad_tensors_naming_them(named, needle):
    with pytest.raises(LayoutMismatch, match=needle):
        Layout.build(named, 4096, 0)


def test_fingerprint_is_stable_and_ignores_bytes_and_unit_settings():
    a = Layout.build([("w", torch.zeros(1000)), ("b", torch.zeros(10))], 4096, 1024)
    b = Layout.build([("w", torch.ones(1000)), ("b", torch.randn(10))], 4096, 1024)
    c = Layout.build([("w", torch.ones(1000)), ("b", torch.randn(10))], 8192, 1024)
    assert a.fingerprint == b.fingerprint == c.fingerprint
    assert a.unit_signature == b.unit_signature != c.unit_signature
    assert a == b and a != c
    a.check_same(b)
    with pytest.raises(LayoutMismatch, match="unit"):
        a.check_same(c)


@pytest.mark.parametrize(
    "other, needle",
    [
        ([("w", torch.zeros(1000)), ("c", torch.zeros(10))], "'b'"),
        ([("w", torch.zeros(1000, dtype=torch.float16)), ("b", torch.zeros(10))], "'w'.*float16"),
        ([("w", torch.zeros(10, 100)), ("b", torch.zeros(10))], "'w'.*shape"),
        ([("w", torch.zeros(1000))], "'b'.*missing"),
        ([("w", torch.zeros(1000)), ("b", torch.zeros(10)), ("x", torch.zeros(1))], "'x'"),
    ],
)
def test_mismatch_names_the_first_differing_tensor(other, needle):
    base = Layout.build([("w", torch.zeros(1000)), ("b", torch.zeros(10))], 4096, 1024)
    assert Layout.build(other, 4096, 1024).fingerprint != base.fingerprint
    with pytest.raises(LayoutMismatch, match=needle):
        base.check_same(Layout.build(other, 4096, 1024))
    with pytest.raises(LayoutMismatch, match=needle):
        base.check_tensors(other)


def test_check_tensors_accepts_other_storage_and_rejects_non_contiguous():
    base = Layout.build([("w", torch.zeros(4, 4))], 4096, 0)
    base.check_tensors([("w", torch.ones(4, 4))])
    with pytest.raises(LayoutMismatch, match="'w'.*contiguous"):
        base.check_tensors([("w", torch.ones(4, 4).t())])


def test_from_metas_equals_build():
    named = _named(100, 5000, 3, 0, 9000)
    lay = Layout.build(named, 4096, 1024)
    assert Layout.from_metas(lay.metas, 4096, 1024) == lay


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.float8_e4m3fn, torch.bool, torch.int64])
def test_checksum_changes_when_one_byte_changes(dtype):
    tensors = [torch.zeros(3000, dtype=torch.uint8).view(dtype) if dtype != torch.bool
               else torch.zeros(3000, dtype=torch.bool), torch.zeros(7, dtype=torch.uint8)]
    lay = Layout.build([("a", tensors[0]), ("b", tensors[1])], 1024, 512)
    before = checksum_all(tensors, lay)
    assert before == checksum_all([t.clone() for t in tensors], lay)
    assert all(0 <= c < 2**64 for c in before)
    tensors[0].view(torch.uint8)[1500] = 1  # unit 1 holds bytes [1024, 2048) of "a"
    after = checksum_all(tensors, lay)
    assert [i for i, (x, y) in enumerate(zip(before, after)) if x != y] == [1]


def test_checksum_of_packed_unit_covers_every_piece():
    tensors = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.float32)]
    lay = Layout.build([("x", tensors[0]), ("y", tensors[1])], 4096, 1024)
    assert lay.unit_count == 1 and len(lay.units[0]) == 2
    c0 = checksum_unit(tensors, lay.units[0])
    tensors[1][2] = 1.0
    assert checksum_unit(tensors, lay.units[0]) != c0


def test_zero_dim_tensor_is_one_element():
    lay = Layout.build([("s", torch.tensor(3.0))], 4096, 1024)
    assert lay.metas[0].shape == () and lay.total_bytes == 4
    assert checksum_all([torch.tensor(3.0)], lay) != checksum_all([torch.tensor(4.0)], lay)
