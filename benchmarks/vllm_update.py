"""One weight update of a few-hundred-MB model into 1 and 2 real vLLM engines (CPU build), four ways.

    python benchmarks/vllm_update.py --json [--reps 3] [--hidden 768 --layers 6]
    (in the vllm environment: bash scripts/test vllm builds it; .venvs/vllm/bin/python ...)

A Llama-shaped fp32 model (vocabulary 32000, GQA, untied head) is built with ``transformers`` in
this process (the trainer) and served by vLLM engines (``LLM(..., weight_transfer_config=
WeightTransferConfig(backend="tensorhub"))``, engine core and worker in their own processes).
Each repetition changes the trainer's weights and moves them into the engines, every path in
turn (the machine is shared and noisy: paths see the same moments):

  tensorhub_direct      TensorHub's backend, direct path (``path="auto"`` takes it: every
                        parameter's placement derived from vLLM's layers): ``send_weights()``,
                        each engine reads exactly its own bytes, in vLLM's fused layout, into its
                        slice buffer, resharded from the trainer's checkpoint layout and verified
                        cell by cell, then copies them into the live parameters and re-packs the
                        CPU build's packed linear layers; no ``load_weights``
  tensorhub_checkpoint  TensorHub's backend, checkpoint-format path (``path="checkpoint"``):
                        ``send_weights()`` (copy into the registered staging buffer, publish,
                        then start / update / finish on each engine: a verified read into the
                        engine's buffer and ``load_weights`` inside vLLM's layerwise reload).
                        Engines updated one after another, so the second reads from the first or
                        the trainer (the scheduler's choice)
  reload_from_disk      ``save_pretrained`` (safetensors) then vLLM's own
                        ``collective_rpc("reload_weights", weights_path=...)`` on each engine
  object_store          ``ray.put`` of the state dict (its reference kept by an actor), then on each
                        engine's worker ``ray.get`` and ``load_weights`` inside the layerwise
                        reload (the naive framework path)
  raw_replicate         the transport alone: a plain TensorHub handle in this process
                        ``replicate()``-s the trainer's published version (same bytes), no engine

Two engines; before each TensorHub path's repetitions they join again on that path (not timed),
so only two engines share the 2 cores (with four, an update's load step took 0.8-1.0 s against
0.1 s for the same step in one engine alone: idle engines' processes compete for the cores). Per path: seconds per update for 1 and 2 engines (best repetition), bytes each engine
received, the bytes each engine's TensorHub buffer holds, and the peak private memory an update
added in the engine's worker process (anonymous memory, sampled every millisecond; after the
first repetition, which also touches pages for the first time; that one is reported apart). The
resident figure (``VmHWM``) is reported too: it also counts a same-host holder's shared memory
the engine maps to read from it, pages the holder owns. ``retention_bytes``: the host memory
each engine's handles and the trainer's keep for retention after a path's last repetition
(engines open with ``retains=False``: none; the trainer keeps the retained versions: the server
asks it to copy each version to host memory in the background once the engines have read it).
Between updates the trainer "trains" for ``--step-s`` seconds (not timed), in which that copy
runs; ``trainer_unpublish_s`` is what the next ``send_weights`` still spent moving off the
previous version (an offload when no copy was made ahead; with ``--step-s 0`` it often is).
Human lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the JSON line only


def say(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _load_from_object_store(worker, store_name: str, namespace: str) -> None:
    """In an engine's worker (a process that joined the cluster): the state dict the trainer put
    in the object store, through the actor that holds its reference, then load_weights."""
    import ray

    from tensorhub.integrations.vllm import _load_checkpoint

    store = ray.get_actor(store_name, namespace=namespace)
    weights = ray.get(ray.get(store.get.remote())[0])
    _load_checkpoint(worker.model_runner.model, worker.model_runner.model_config, list(weights.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON summary line on stdout")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=0.5,
                    help="seconds the trainer 'trains' between updates (not timed)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()

    import ray
    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import tensorhub
    from tensorhub.integrations import vllm as thv
    from tensorhub.testing import memory

    namespace = f"bench-vllm-{uuid.uuid4().hex[:6]}"
    ray.init(num_cpus=8, namespace=namespace, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Store:
        """Holds the trainer's object reference (a framework's driver or trainer actor would)."""

        def __init__(self) -> None:
            self.refs: list = []

        def put(self, refs: list) -> None:
            self.refs = refs

        def get(self) -> list:
            return self.refs

    store = Store.options(name="bench-store", namespace=namespace).remote()
    h = args.hidden
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                                   num_hidden_layers=args.layers, num_attention_heads=h // 64,
                                   num_key_value_heads=max(1, h // 256), tie_word_embeddings=False,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    policy = transformers.LlamaForCausalLM(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    tmp = tempfile.mkdtemp(prefix="bench-vllm-")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    policy.save_pretrained(f"{tmp}/init")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(f"{tmp}/init")
    say(f"model {model_bytes / 2**20:.0f} MiB; starting 2 engines")
    engines = [LLM(model=f"{tmp}/init", dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=2,
                   seed=0, weight_transfer_config=WeightTransferConfig(backend=thv.BACKEND)) for _ in range(2)]
    model_name = f"bench-vllm-{uuid.uuid4().hex[:6]}"

    trainer = WeightTransferTrainerFactory.trainer_init(thv.TensorHubTrainerInitInfo(model=model_name, rank=0),
                                                        client=thv.LocalLLMClient(*engines), source=ModuleSource(policy))
    reports: dict[str, list] = {}

    def join(path: str) -> None:
        """The engines leave their registration and join again on ``path`` (not timed)."""
        for e in engines:
            e.init_weight_transfer_engine({"init_info": {"model": model_name, "ray_address": thv._gcs_address(),
                                                         "path": path.removeprefix("tensorhub_")}})
        reports[path] = [e.collective_rpc(thv.report)[0] for e in engines]
        assert all(r["path"] == path.removeprefix("tensorhub_") for r in reports[path]), reports

    plain = tensorhub.open(model_name, replica="bench-raw-reader")
    plain.register([(n, torch.empty_like(t)) for n, t in trainer.buffer], placement=trainer.placement)
    best: dict[str, float] = {}
    received: dict[str, list[int]] = {}
    split: dict[str, list] = {}  # path/engines -> per engine (read s, load s) of the last repetition
    extra: dict[str, list[int]] = {}  # per repetition: the most private memory an update added in one engine
    extra_rss: dict[str, list[int]] = {}  # the same, resident in all (with mapped shared memory)
    retention: dict[str, dict] = {}  # path/engines -> host memory held for retention (engines, trainer)
    unpublish_s: dict[str, list[float]] = {}  # path/engines -> per repetition: send_weights' unpublish
    g = torch.Generator().manual_seed(1)

    def timed(key: str, n: int, fn) -> None:
        for e in engines[:n]:
            e.collective_rpc(memory.mark)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        added = [e.collective_rpc(memory.peak)[0] for e in engines[:n]]
        extra.setdefault(key, []).append(max(a["anon"] for a in added))
        extra_rss.setdefault(key, []).append(max(a["rss"] for a in added))
        best[key] = min(best.get(key, float("inf")), dt)

    try:
        for path in ("tensorhub_checkpoint", "tensorhub_direct"):
            join(path)
            for rep in range(args.reps):
                for n in (1, 2):
                    with torch.no_grad():
                        for p in policy.parameters():
                            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
                    trainer.client = thv.LocalLLMClient(*engines[:n])
                    time.sleep(args.step_s)  # training: the trainer's host copy is made meanwhile
                    timed(f"{path}/{n}", n, trainer.send_weights)
                    unpublish_s.setdefault(f"{path}/{n}", []).append(round(trainer.unpublish_s, 4))
                    last = [e.collective_rpc(thv.report)[0] for e in engines[:n]]
                    received[f"{path}/{n}"] = [r["last_read_bytes"] for r in last]
                    split[f"{path}/{n}"] = [r["last_split_s"] for r in last]
                    retention[f"{path}/{n}"] = {"engines": [r["retention_bytes"] for r in last],
                                                "trainer": trainer.hub.host_copies.held_bytes()}
                say(f"{path} rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(best.items())))
        for rep in range(args.reps):
            for n in (1, 2):
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 1e-3)
                trainer.client = thv.LocalLLMClient()
                trainer.send_weights()  # published, no engine: the raw reader's version
                t0 = time.perf_counter()
                plain.update(trainer.version)
                best[f"raw_replicate/{n}"] = min(best.get(f"raw_replicate/{n}", float("inf")),
                                                 (time.perf_counter() - t0) * n)

                def from_disk(n=n):
                    path = f"{tmp}/rep{rep}-{n}"
                    policy.save_pretrained(path)
                    for e in engines[:n]:
                        e.collective_rpc("reload_weights", kwargs={"weights_path": path})
                timed(f"reload_from_disk/{n}", n, from_disk)

                def from_object_store(n=n):
                    ref = ray.put({k: v.detach() for k, v in policy.state_dict().items()})
                    ray.get(store.put.remote([ref]))  # in a list: the reference, not its value
                    for e in engines[:n]:
                        e.collective_rpc(_load_from_object_store, args=("bench-store", namespace))
                timed(f"object_store/{n}", n, from_object_store)
            say(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(best.items())))
        sample = engines[0].generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4),
                                     use_tqdm=False)
        assert sample and sample[0].outputs[0].token_ids
    finally:
        plain.close(drop_last_copy=True)
        for e in engines:
            e.shutdown_weight_transfer_engine()  # the engines' handles leave before the cluster goes
        trainer.shutdown()
        trainer.client = None
        engines.clear()
        gc.collect()  # the engines' processes end here
        ray.shutdown()

    paths = ("tensorhub_direct", "tensorhub_checkpoint", "reload_from_disk", "object_store", "raw_replicate")
    out = {"bench": "vllm_update", "reps": args.reps, "model_bytes": model_bytes, "engines": [1, 2],
           "seconds": {p: {str(n): round(best[f"{p}/{n}"], 4) for n in (1, 2)} for p in paths},
           "bytes_received_per_engine": {k: v for k, v in received.items()},
           "buffer_bytes_per_engine": {p: [r["slice_bytes"] for r in reps] for p, reps in reports.items()},
           "tensorhub_read_load_s": {k: [[round(x, 4) for x in pair] for pair in v] for k, v in split.items()},
           # host memory kept for retention after the last repetition: each engine's handles
           # (none: engines open with retains=False) and the trainer's (its host copies, its pool)
           "retention_bytes": retention,
           # per repetition: the part of send_weights that moved off the previous version
           "trainer_unpublish_s": unpublish_s, "step_s": args.step_s,
           # the first repetition also touches pages an engine has not used yet; the steady
           # figure is the most any later repetition added
           "extra_memory_per_engine_first": {p: {str(n): extra[f"{p}/{n}"][0] for n in (1, 2)} for p in paths[:4]},
           "extra_memory_per_engine": {p: {str(n): max(extra[f"{p}/{n}"][1:] or extra[f"{p}/{n}"]) for n in (1, 2)}
                                       for p in paths[:4]},
           # resident memory in all: also the holders' shared memory an engine mapped to read it
           "extra_resident_per_engine": {p: {str(n): extra_rss[f"{p}/{n}"] for n in (1, 2)} for p in paths[:4]},
           "load_avg": os.getloadavg()[0]}
    for n in (1, 2):
        direct, ck = best[f"tensorhub_direct/{n}"], best[f"tensorhub_checkpoint/{n}"]
        raw = best[f"raw_replicate/{n}"]
        out[f"disk_over_direct_{n}"] = round(best[f"reload_from_disk/{n}"] / direct, 2)
        out[f"disk_over_checkpoint_{n}"] = round(best[f"reload_from_disk/{n}"] / ck, 2)
        out[f"object_store_over_direct_{n}"] = round(best[f"object_store/{n}"] / direct, 2)
        out[f"checkpoint_over_direct_{n}"] = round(ck / direct, 2)
        out[f"direct_over_raw_replicate_{n}"] = round(direct / raw, 2)
        out[f"checkpoint_over_raw_replicate_{n}"] = round(ck / raw, 2)
        for p in ("direct", "checkpoint"):
            out[f"extra_memory_ratio_{p}_{n}"] = round(out["extra_memory_per_engine"][f"tensorhub_{p}"][str(n)]
                                                        / model_bytes, 4)
    out["goals"] = {"disk_over_direct": 5.0, "extra_memory_ratio": 0.01, "direct_over_raw_replicate": 1.2}
    say(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
