"""Benchmark: a run's two evaluations (before and after training) of the default recipe, as the
Trainer of the source tree in the current directory calls them, so that one script times an old
commit and the current one under the same conditions:

  git worktree add /tmp/before-39 fa2bdbe
  (cd /tmp/before-39 && python /path/to/rljax/scripts/bench_eval_two_evals.py then)
  python scripts/bench_eval_two_evals.py now
  # then compare /tmp/rljax-eval-{then,now}-{before,after}.jsonl: the same completions

SmolLM2-135M-Instruct, the recipe's held-out examples, greedy. Prints the wall seconds of each
evaluation (the first includes compiling the sampler; code before issue 39 compiled it for each
evaluation) and the batch of prompts decoded at once.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())   # the tree being measured, not the installed package

import rljax  # noqa: E402
from rljax.configs import default as recipe  # noqa: E402
from rljax.data import build_dataset  # noqa: E402
from rljax.rewards import RewardPool, RewardSpec  # noqa: E402
from rljax.trainer import evaluate  # noqa: E402
from rljax.trainer.loop import sampling_params  # noqa: E402


def reward_spec(c):
  try:   # per-source verifier routing (after issue 35)
    from rljax.rewards.routing import source_verifiers_from_data
  except ImportError:
    return RewardSpec.from_dict(c.rewards.to_dict())
  return RewardSpec.from_dict(c.rewards.to_dict(), source_verifiers=source_verifiers_from_data(c.data))


def eval_batch(c) -> int:
  """Prompts decoded at once, as that tree's Trainer.evaluate chooses them."""
  if hasattr(evaluate, "prompts_per_batch"):
    rows = c.eval.batch_size or max(128, c.train.prompts_per_step * c.sampling.num_samples)
    return evaluate.prompts_per_batch(rows, c.eval.samples, c.eval.num_examples)
  return max(c.train.prompts_per_step, 8)


def main(label: str) -> None:
  c = recipe.get_config()
  policy = rljax.load_pretrained(c.model.path)
  data = build_dataset(c.data.to_dict(), split="test", process_index=0, process_count=1)
  batch = eval_batch(c)
  print(label, "prompts at once:", batch, "examples:", c.eval.num_examples, flush=True)
  sp = sampling_params(c, policy.tokenizer, num_samples=c.eval.samples, temperature=c.eval.temperature,
                       max_new_tokens=c.eval.max_new_tokens or None)
  times = []
  with RewardPool(reward_spec(c)) as pool:
    for tag in ("before", "after"):
      start = time.perf_counter()
      m = evaluate.evaluate_policy(policy.config, policy.params, policy.tokenizer, data, pool,
                                   num_examples=c.eval.num_examples, samples=c.eval.samples, sampling=sp,
                                   max_prompt_tokens=c.data.max_prompt_tokens, batch_prompts=batch,
                                   out_path=f"/tmp/rljax-eval-{label}-{tag}.jsonl", seed=c.train.seed)
      times.append(time.perf_counter() - start)
      print(label, tag, f"{times[-1]:.1f} s, accuracy {m.get('accuracy')}", flush=True)
  print(label, f"two evaluations: {sum(times):.1f} s", json.dumps(times), flush=True)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "now")
