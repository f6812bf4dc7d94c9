"""Benchmark: the default run's held-out evaluation, decoding 8 prompts at a time with every prompt
prefilled whole (rljax before issue 39) against the batch it decodes now with the prompts' shared
system prompt prefilled once per batch, in the same run, with the same results.

SmolLM2-135M-Instruct (the built-in model), the default recipe's 128 held-out arithmetic
problems, greedy, 16 new tokens and 48-token prompts, as `rljax train` evaluates before and
after training. Each side evaluates twice, as a run does (before and after training): the
first includes compiling the sampler, the second is what an evaluation costs once compiled
(the trainer now keeps the compiled sampler; before, it compiled it again for every
evaluation). Asserts that both sides give the same completions.

  python scripts/bench_eval.py [--num-examples 128] [--max-new-tokens 16] [--batch-prompts 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchlib import Result, add_json_arg, report  # noqa: E402

import rljax  # noqa: E402
from rljax import compile_stats  # noqa: E402
from rljax.configs import default as default_recipe  # noqa: E402
from rljax.data import build_dataset  # noqa: E402
from rljax.rewards import RewardPool, RewardSpec  # noqa: E402
from rljax.rewards.routing import source_verifiers_from_data  # noqa: E402
from rljax.trainer import evaluate  # noqa: E402
from rljax.trainer.loop import sampling_params  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--num-examples", type=int, default=128)
  p.add_argument("--max-new-tokens", type=int, default=16)
  p.add_argument("--batch-prompts", type=int, default=64, help="rljax's side: prompts decoded at once")
  p.add_argument("--before-prompts", type=int, default=8, help="the side before issue 39")
  add_json_arg(p)
  args = p.parse_args(argv)
  compile_stats.install()
  cfg = default_recipe.get_config()
  policy = rljax.load_pretrained(cfg.model.path)
  dataset = build_dataset(cfg.data.to_dict(), split="test")
  spec = RewardSpec.from_dict(cfg.rewards.to_dict(), source_verifiers=source_verifiers_from_data(cfg.data))
  outputs = {}
  with RewardPool(spec) as pool:
    for label, size in (("before", args.before_prompts), ("now", args.batch_prompts)):
      out = os.path.join("/tmp", f"rljax-bench-eval-{label}.jsonl")
      evaluate._sample_fn.cache_clear()
      sp = sampling_params(cfg, policy.tokenizer, num_samples=1, temperature=0.0, max_new_tokens=args.max_new_tokens)
      compiled = compile_stats.counts()["compile_seconds"]
      times = []
      for _ in range(2):
        start = time.perf_counter()
        metrics = evaluate.evaluate_policy(policy.config, policy.params, policy.tokenizer, dataset, pool,
                                           num_examples=args.num_examples, samples=1, sampling=sp,
                                           max_prompt_tokens=cfg.data.max_prompt_tokens, batch_prompts=size,
                                           out_path=out, shared_prefix=label == "now")
        times.append(time.perf_counter() - start)
      with open(out, encoding="utf-8") as f:
        outputs[label] = (times, compile_stats.counts()["compile_seconds"] - compiled, metrics, f.read())
      print(f"{label}: {size} prompts at a time: {times[0]:.1f} s, then {times[1]:.1f} s "
            f"(compiling {outputs[label][1]:.1f} s); {metrics['tokens_per_s']:.0f} tokens/s", flush=True)
  (tb, _, mb, rows_b), (tn, _, mn, rows_n) = outputs["before"], outputs["now"]
  if rows_b != rows_n:
    raise SystemExit("the two sides gave different completions (greedy results must not depend on the batch size "
                     "or the shared-prefix prefill)")
  what = f"{args.num_examples} greedy examples x {args.max_new_tokens} tokens"
  # Before issue 39 the trainer compiled the sampler for every evaluation: a run's two cost 2 x the first.
  before_run, now_run = 2 * tb[0], tn[0] + tn[1]
  results = [
      Result(f"evaluation, the default run's {what}: seconds once compiled ({args.batch_prompts} prompts at a "
             f"time, shared prefix prefilled once, vs {args.before_prompts}; same completions)", f"{tn[1]:.1f} s",
             f"{args.before_prompts} at a time: {tb[1]:.1f} s", f"{tb[1] / tn[1]:.2f}x faster"),
      Result("evaluation: a run's two evaluations (before and after training), compiling included; before "
             "issue 39 each compiled the sampler again", f"{now_run:.1f} s", f"{before_run:.1f} s",
             f"{before_run / now_run:.2f}x faster"),
      Result("evaluation: generated tokens/s, compile excluded", f"{mn['tokens_per_s']:.0f}",
             f"{mb['tokens_per_s']:.0f}", f"{mn['tokens_per_s'] / mb['tokens_per_s']:.2f}x"),
  ]
  report(results, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
