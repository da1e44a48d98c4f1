"""Checksum candidates for transfer units (issue 27 item 2): hash alone, and fused with the copy.

    python benchmarks/hashes.py --json [--reps 5] [--buffer-mib 512] [--piece-mib 64,16,1] [--slice-kib 1024]

One warm buffer pair (``src`` random bytes, ``dst`` touched once by a full copy: fresh pages are
slow on the development VM), torch held to one intra-op thread so that "threads" below means
exactly the threads this script starts. Each repetition runs every mode once, in turn (the
machine is shared and noisy: modes see the same moments); a mode's figure is its best
repetition, GB/s = buffer bytes / seconds. The buffer is cut into pieces of ``--piece-mib``
(the sizes units have: ``unit_bytes`` is 16 MiB by default, 64 MiB was the issue's figure);
with 2 threads each thread takes one contiguous half of the pieces, as the same-host tier's
copy threads take runs of units.

  memcpy         one torch ``dst.copy_(src)`` of the whole buffer, one thread: the baseline
  copy           per piece ``dst[p].copy_(src[p])`` on 1 and 2 threads
  hash           per piece ``h(dst[p])`` on 1 and 2 threads: the hash alone
  fused          per piece the copy then the hash of the piece just written, on 1 and 2
                 threads: what ``tensorhub.transport.shm._copy_units`` does with checksums on
  fused_sliced   the same value, but each piece copied and fed to a streaming hash in slices of
                 ``--slice-kib`` (1 MiB: a core's L2 here), so the hash reads bytes still in
                 cache instead of reading the whole piece back from memory (pieces > a slice)

Candidates, each skipped (and named under ``missing`` with the reason) when its package is not
importable or lacks the fast path:

  xxh3_64        ``xxhash.xxh3_64`` object, ``update`` + ``intdigest``: today's
                 :func:`tensorhub.layout.checksum_unit`
  xxh3_128       ``xxhash.xxh3_128``, same calls
  blake3         ``blake3.blake3(data, max_threads=1)``, 64-bit digest (``digest(8)``)
  blake3_mt      ``blake3.blake3(data, max_threads=blake3.AUTO)``: its own threads inside one call
  crc32c         ``crc32c.crc32c`` (ICRAR package), only when ``crc32c.hardware_based``
  google_crc32c  ``google_crc32c.value``, only when ``google_crc32c.implementation == "c"``;
                 it takes ``bytes`` only (a buffer of a tensor is refused), so ``hash`` runs on
                 prepared ``bytes`` copies of the pieces and ``fused`` pays ``bytes(piece)``

Whether a library releases the GIL is probed, not assumed: while another thread hashes the
whole buffer in one call, the main thread spins a Python loop and records its longest stop.
Holding the GIL stops it for the whole call; released, it stops only for scheduling noise
(``gil_released``: stopped under half the call, in the best of 3 tries). Without a release
2 threads cannot hash faster than 1.

Ratios are to baselines of the same run: ``hash_over_memcpy`` (hash alone / memcpy),
``fused_over_copy`` (fused and fused_sliced over copy of the same pieces and threads: the
tier's cost of checksums, 1 = free), ``two_over_one_thread``. Human lines go to stderr; with
``--json`` the last stdout line is one JSON object. Runs with only ``xxhash`` installed (the
project's venv); the others: ``pip install blake3 crc32c google-crc32c``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import json
import os
import sys
import threading
import time
from typing import Callable, Sequence

import torch

_THREADS = (1, 2)


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A hash: ``seq(parts)`` is one value over the buffers ``parts`` in order (streaming, as
    :func:`tensorhub.layout.checksum_unit` hashes a unit's pieces), equal to the value of their
    concatenation."""
    name: str
    seq: Callable[[Sequence], int]
    digest_bits: int
    version: str
    needs_bytes: bool = False
    note: str = ""

    def fn(self, data) -> int:
        return self.seq((data,))


def _xxh(cls) -> Callable[[Sequence], int]:
    def seq(parts) -> int:
        x = cls()
        for p in parts:
            x.update(p)
        return x.intdigest()
    return seq


def _blake3(b3, max_threads: int) -> Callable[[Sequence], int]:
    def seq(parts) -> int:
        x = b3(max_threads=max_threads)
        for p in parts:
            x.update(p)
        return int.from_bytes(x.digest(8), "little")
    return seq


def _crc32c(crc32c) -> Callable[[Sequence], int]:
    def seq(parts) -> int:
        crc = 0
        for p in parts:
            crc = crc32c(p, crc)
        return crc
    return seq


def _google_crc32c(extend) -> Callable[[Sequence], int]:
    def seq(parts) -> int:
        crc = 0
        for p in parts:
            crc = extend(crc, p if isinstance(p, bytes) else bytes(p))
        return crc
    return seq


def candidates() -> tuple[list[Candidate], dict[str, str]]:
    """The candidates importable here with their fast path, and name -> why for the others."""
    found: list[Candidate] = []
    missing: dict[str, str] = {}
    names = {"xxhash": ("xxh3_64", "xxh3_128"), "blake3": ("blake3", "blake3_mt"),
             "crc32c": ("crc32c",), "google_crc32c": ("google_crc32c",)}

    def load(module: str):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            for n in names[module]:
                missing[n] = f"{module} not importable: {e}"
            return None

    if (m := load("xxhash")) is not None:
        v = f"xxhash {m.VERSION} (xxHash {m.XXHASH_VERSION})"
        found += [Candidate("xxh3_64", _xxh(m.xxh3_64), 64, v), Candidate("xxh3_128", _xxh(m.xxh3_128), 128, v)]
    if (m := load("blake3")) is not None:
        v = f"blake3 {getattr(m, '__version__', '?')}"
        found.append(Candidate("blake3", _blake3(m.blake3, 1), 64, v, note="256-bit hash cut to 64 bits"))
        found.append(Candidate("blake3_mt", _blake3(m.blake3, m.blake3.AUTO), 64, v,
                               note=f"max_threads=AUTO (its own pool, sized to the {os.cpu_count()} CPUs)"))
    if (m := load("crc32c")) is not None:
        if m.hardware_based:
            found.append(Candidate("crc32c", _crc32c(m.crc32c), 32, f"crc32c {m.__version__}",
                                   note="hardware (SSE4.2)"))
        else:
            missing["crc32c"] = "crc32c.hardware_based is False (software fallback)"
    if (m := load("google_crc32c")) is not None:
        if m.implementation == "c":
            found.append(Candidate("google_crc32c", _google_crc32c(m.extend), 32, "google-crc32c", needs_bytes=True,
                                   note="takes bytes only: hash on prepared bytes, fused pays bytes(piece)"))
        else:
            missing["google_crc32c"] = f"google_crc32c.implementation is {m.implementation!r}, not 'c'"
    return found, missing


def gil_probe(c: Candidate, data) -> tuple[float, float]:
    """(seconds of one hash call over ``data`` in another thread, longest gap between turns of a
    Python loop in this thread meanwhile). A hash that holds the GIL stops this thread for the
    whole call (gap >= call); one that releases it leaves gaps of scheduling noise only."""
    started, done = threading.Event(), threading.Event()
    call = [0.0]

    def work() -> None:
        started.set()
        t0 = time.perf_counter()
        c.fn(data)
        call[0] = time.perf_counter() - t0
        done.set()
    th = threading.Thread(target=work)
    th.start()
    gap, last = 0.0, time.perf_counter()
    started.wait()
    while not done.is_set():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    gap = max(gap, time.perf_counter() - last)
    th.join()
    return call[0], gap


class Bench:
    """The buffers, their pieces per size, and the modes as functions of (piece size, threads)."""

    def __init__(self, nbytes: int, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.nbytes = nbytes
        self.pool = pool
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # touch: fresh pages are slow here
        self.mv = memoryview(self.dst.numpy())
        self.as_bytes: dict[int, list[bytes]] = {}

    def pieces(self, piece: int, part: int) -> list[list[tuple[torch.Tensor, torch.Tensor, memoryview]]]:
        """The buffer in pieces of ``piece`` bytes, each a list of (src, dst, dst bytes) parts of
        ``part`` bytes (one part when ``part >= piece``)."""
        part = min(part, piece)
        return [[(self.src[o:o + part], self.dst[o:o + part], self.mv[o:o + part]) for o in range(p, p + piece, part)]
                for p in range(0, self.nbytes, piece)]

    def on_threads(self, threads: int, items: list, work: Callable[[list], None]) -> float:
        """Seconds for ``threads`` pool threads to run ``work`` over contiguous shares of ``items``."""
        share = -(-len(items) // threads)
        t0 = time.perf_counter()
        futs = [self.pool.submit(work, items[i:i + share]) for i in range(0, len(items), share)]
        for f in futs:
            f.result()
        return time.perf_counter() - t0

    def memcpy(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


def _copied(piece):
    """Copy the parts of a piece one by one, yielding each part's bytes once it is written: a
    hash fed from this hashes each part right after its copy."""
    for s, d, m in piece:
        d.copy_(s)
        yield m


def modes(b: Bench, cands: list[Candidate], piece_sizes: list[int],
          slice_bytes: int) -> dict[tuple, Callable[[], float]]:
    """(kind, candidate, piece bytes, threads) -> a function running that mode once (seconds)."""
    out: dict[tuple, Callable[[], float]] = {("memcpy", "", 0, 1): b.memcpy}

    def copy(items):
        for piece in items:
            for s, d, _ in piece:
                d.copy_(s)

    for piece in piece_sizes:
        whole, sliced = b.pieces(piece, piece), b.pieces(piece, slice_bytes)
        for t in _THREADS:
            out[("copy", "", piece, t)] = lambda t=t, ps=whole: b.on_threads(t, ps, copy)
        for c in cands:
            def hash_(items, h=c.fn):
                for x in items:
                    h(x)

            def fused(items, seq=c.seq):
                for p in items:
                    seq(_copied(p))
            inputs = [p[0][2] for p in whole]
            if c.needs_bytes:
                inputs = b.as_bytes.setdefault(piece, [bytes(m) for m in inputs])
            for t in _THREADS:
                out[("hash", c.name, piece, t)] = lambda t=t, i=inputs, f=hash_: b.on_threads(t, i, f)
                out[("fused", c.name, piece, t)] = lambda t=t, ps=whole, f=fused: b.on_threads(t, ps, f)
                if piece > slice_bytes:
                    out[("fused_sliced", c.name, piece, t)] = lambda t=t, ps=sliced, f=fused: b.on_threads(t, ps, f)
    return out


def nest(flat: dict[tuple, float]) -> dict:
    """{(kind, cand, piece, threads): v} -> {kind: {cand: {"64MiB": {"1": v}}}} (no cand level for copy)."""
    out: dict = {}
    for (kind, cand, piece, t), v in flat.items():
        if kind == "memcpy":
            out["memcpy"] = v
            continue
        node = out.setdefault(kind, {})
        if cand:
            node = node.setdefault(cand, {})
        node.setdefault(f"{piece >> 20}MiB", {})[str(t)] = v
    return out


def check_values(b: Bench, cands: list[Candidate], piece: int, slice_bytes: int) -> None:
    """Each candidate gives one value for a piece whether hashed whole or fed in slices (what
    hashing right after each slice's copy relies on); raises AssertionError if not."""
    whole, sliced = b.pieces(piece, piece)[0], b.pieces(piece, slice_bytes)[0]
    for c in cands:
        assert c.seq([m for _, _, m in sliced]) == c.fn(whole[0][2]), c.name


def summary(g: dict[tuple, float], nbytes: int, args, cands: list[Candidate], missing: dict[str, str],
            gil: dict[str, tuple[float, float]], piece_sizes: list[int]) -> dict:
    """The JSON object from the best GB/s per mode ``g``."""
    memcpy = g[("memcpy", "", 0, 1)]
    hash_over_memcpy = {k: round(v / memcpy, 3) for k, v in g.items() if k[0] == "hash"}
    over_copy = {k: round(v / g[("copy", "", k[2], k[3])], 3) for k, v in g.items() if k[0].startswith("fused")}
    speedup = {(kind, c, p, 2): round(g[(kind, c, p, 2)] / g[(kind, c, p, 1)], 3)
               for (kind, c, p, t) in g if kind != "memcpy" and t == 1}
    return {"bench": "hashes", "buffer_bytes": nbytes, "reps": args.reps, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "threads": list(_THREADS),
            "pieces_mib": [p >> 20 for p in piece_sizes], "slice_kib": args.slice_kib,
            "candidates": {c.name: {"version": c.version, "digest_bits": c.digest_bits, "zero_copy": not c.needs_bytes,
                                    "gil_probe_call_ms": round(gil[c.name][0] * 1e3, 1),
                                    "gil_probe_main_stopped_ms": round(gil[c.name][1] * 1e3, 1),
                                    "gil_released": gil[c.name][1] < gil[c.name][0] / 2, "note": c.note}
                           for c in cands},
            "missing": missing,
            "gbps": nest({k: round(v, 2) for k, v in g.items()}),
            "hash_over_memcpy": nest(hash_over_memcpy).get("hash", {}),
            "fused_over_copy": nest(over_copy),
            "two_over_one_thread": nest(speedup)}


def table(g: dict[tuple, float], cands: list[Candidate], piece_sizes: list[int]) -> None:
    """Human lines: GB/s per mode, ``1 thread/2 threads``."""
    def cell(kind, c, p):
        k1, k2 = (kind, c, p, 1), (kind, c, p, 2)
        return f"{g[k1]:5.1f}/{g[k2]:5.1f}" if k1 in g else " " * 11
    say(f"memcpy {g[('memcpy', '', 0, 1)]:.2f} GB/s; GB/s on 1/2 threads, per piece size:")
    say(f"{'':28s}" + "".join(f"{p >> 20:>9d} MiB " for p in piece_sizes))
    say(f"{'copy':28s}" + "".join(cell("copy", "", p) + "  " for p in piece_sizes))
    for c in cands:
        for kind in ("hash", "fused", "fused_sliced"):
            say(f"{c.name + ' ' + kind:28s}" + "".join(cell(kind, c.name, p) + "  " for p in piece_sizes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--buffer-mib", type=int, default=512)
    ap.add_argument("--piece-mib", default="64,16,1", help="comma-separated piece (unit) sizes in MiB")
    ap.add_argument("--slice-kib", type=int, default=1024, help="part size of the fused_sliced mode")
    args = ap.parse_args()
    torch.set_num_threads(1)
    nbytes, slice_bytes = args.buffer_mib << 20, args.slice_kib << 10
    piece_sizes = [int(x) << 20 for x in args.piece_mib.split(",")]
    assert all(nbytes % p == 0 and p % slice_bytes == 0 for p in piece_sizes), "whole pieces, whole slices"
    cands, missing = candidates()
    for n, why in missing.items():
        say(f"skipped {n}: {why}")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(_THREADS), thread_name_prefix="hashes")
    b = Bench(nbytes, pool)
    check_values(b, cands, piece_sizes[0], slice_bytes)
    gil = {}
    for c in cands:  # the least stopped of 3 tries: the machine is shared, a stop may be another process
        data = bytes(b.mv) if c.needs_bytes else b.mv
        gil[c.name] = min((gil_probe(c, data) for _ in range(3)), key=lambda cg: cg[1] / cg[0])
        del data
    say("GIL probe (one call over the buffer, ms / longest stop of the main thread, ms): "
        + ", ".join(f"{n} {call * 1e3:.0f}/{gap * 1e3:.1f}" for n, (call, gap) in gil.items()))
    fns = modes(b, cands, piece_sizes, slice_bytes)
    best = {k: float("inf") for k in fns}
    for rep in range(args.reps):
        for k, fn in fns.items():
            best[k] = min(best[k], fn())
        say(f"rep {rep}: memcpy {nbytes / best[('memcpy', '', 0, 1)] / 1e9:.2f} GB/s")
    assert torch.equal(b.dst, b.src)
    pool.shutdown()
    g = {k: nbytes / s / 1e9 for k, s in best.items()}
    table(g, cands, piece_sizes)
    out = summary(g, nbytes, args, cands, missing, gil, piece_sizes)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
