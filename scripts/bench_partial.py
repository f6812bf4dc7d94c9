"""Partial rollouts vs the fused mode on completions with a long tail of lengths.

    python scripts/bench_partial.py                   # ~5 min on 2 cores
    python scripts/bench_partial.py --steps 8 --new-tokens 256

A small random Llama (the smoke recipe's task, SmolLM2's tokenizer) trains `--steps` steps of
8 prompts x G=8 in the fused mode and in rollout.mode='partial' (a pool of 16 groups, a round ends
once 8 have finished). A random model almost never emits EOS, so `--stop-fraction` of the
vocabulary is made stop tokens: completion lengths are then geometric (mean ~1/p tokens) with a
tail to max_new_tokens, the shape that makes one long completion hold a fused batch.

Reported: completions/s (the first step of each mode, compilation, excluded) and decode steps per
trained batch (fused: the longest completion; partial: the steps of the round). What a CPU can
show: the decode steps a batch waits for. What it cannot: on this compute-bound CPU a decode step
costs in proportion to its rows, so the partial mode's 2x pool costs ~2x per step; on
accelerators decode is memory-bound, extra rows are nearly free, and the decode steps are the
wall-clock.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchlib import Result, add_json_arg, machine, report  # noqa: E402


def run_mode(mode: str, args) -> dict:
  from rljax.config_overrides import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  with tempfile.TemporaryDirectory() as out:
    cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py"))
    apply_overrides(cfg, [
        f"output.dir={out!r}", "checkpoint.resume=False", f"train.steps={args.steps}", f"rollout.mode={mode!r}",
        f"sampling.max_new_tokens={args.new_tokens}", f"model.random.hidden_size={args.hidden}",
        f"model.random.intermediate_size={4 * args.hidden}", f"model.random.num_layers={args.layers}",
        "model.random.head_dim=32", "model.random.num_heads=4", "optim.learning_rate=0.01",
        "output.tensorboard=False"])
    trainer = Trainer(cfg)   # the vocabulary size is known once the tokenizer is loaded
    trainer.close()
    cfg.sampling.stop_token_ids = list(range(100, 100 + int(args.stop_fraction * trainer.tokenizer.vocab_size)))
    trainer = Trainer(cfg)
    try:
      metrics = [trainer.run_step()]
      start = time.perf_counter()
      metrics += [trainer.run_step() for _ in range(args.steps - 1)]
      wall = time.perf_counter() - start
    finally:
      trainer.close()
  timed = metrics[1:]
  per_step = cfg.train.prompts_per_step * cfg.sampling.num_samples
  steps_key = "rollout/decode_steps" if mode == "partial" else "response_length_max"
  return {"mode": mode, "completions_per_s": per_step * len(timed) / wall,
          "decode_steps": statistics.mean(m[steps_key] for m in timed),
          "length": statistics.mean(m["response_length_mean"] for m in timed),
          "s_per_step": wall / len(timed)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--stop-fraction", type=float, default=0.05, help="share of the vocabulary that stops a completion")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  add_json_arg(p)
  args = p.parse_args()
  logging.basicConfig(level=logging.WARNING)
  print(machine())
  fused, part = run_mode("fused", args), run_mode("partial", args)
  for r in (fused, part):
    print(f"{r['mode']:<8} {r['s_per_step']:6.2f} s/step  {r['completions_per_s']:6.2f} completions/s  "
          f"{r['decode_steps']:6.1f} decode steps/batch  mean length {r['length']:.1f}")
  report([
      Result(f"partial rollouts (pool 2x), {args.new_tokens}-token budget, geometric lengths: decode steps per batch",
             f"{part['decode_steps']:.1f}", f"fused {fused['decode_steps']:.1f}",
             f"{fused['decode_steps'] / part['decode_steps']:.2f}x fewer"),
      Result("partial rollouts: completions/s on this CPU (decode cost ~ rows here)",
             f"{part['completions_per_s']:.2f}", f"fused {fused['completions_per_s']:.2f}",
             f"{part['completions_per_s'] / fused['completions_per_s']:.2f}x"),
  ], args.json)


if __name__ == "__main__":
  main()
