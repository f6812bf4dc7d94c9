"""Continuous batching (sampling.slots) against the fixed-shape sampler on long-tailed completion lengths.

    python scripts/bench_longtail.py                        # slots = 64 (rows), 32, 16; ~3 min on 2 cores
    python scripts/bench_longtail.py --slots 0,16 --reps 8
    python scripts/bench_longtail.py --train                # also whole training steps (sample, score, update)
    python scripts/bench_longtail.py --memory               # also compiled sampler memory at SmolLM2-135M shapes

The work: 8 prompts x G=8 completions of at most `--new-tokens` (128) from a small random Llama
(hidden 256, 4 layers, SmolLM2's 49,152-token vocabulary), float32, one CPU device. A random model
almost never emits EOS, so a share p of the vocabulary is made stop tokens: completion lengths are
then geometric, with p chosen so that `--at-budget` of them (3%: about 2 of 64) reach the budget
((1 - p)^(T - 1) = 3%: mean ~37 tokens): most completions stop early, a few run to max_new_tokens,
the shape that makes the longest row hold a fixed-shape batch.

Each `--slots` value (0 = one slot per row, today's fixed-shape loop) is compiled once and the
sides are run in turn, `--reps` times each (A, B, C, A, B, C, ...) with a new key per round, so
every side sees the same machine load and the same prompts and keys; the script checks that every
side drew the same tokens (the sampler is exact across slot counts). Reported per side: decode
steps per batch, slot utilisation (tokens decoded / (slots x decode steps)) and the median wall
time of a batch's generation, with ratios against the first side. With `--train`, the smoke
recipe's task trains `--steps` fused steps per side (steps interleaved the same way) and the whole
step's time is reported too (the update, the same work on every side, is most of it here).

What transfers from this CPU: the decode steps and the utilisation. A CPU decode step costs about
in proportion to the rows it computes, so fewer, fuller slots cost less here; an accelerator's
decode step is bound by reading weights and cache, so fewer slots mostly save KV memory and its
reads (`--memory`), and the decode steps are what its wall time follows.
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

PROMPTS, GROUP, VOCAB = 8, 8, 49152


def stop_fraction(new_tokens: int, at_budget: float) -> float:
  """p with (1 - p)^(T - 1) = at_budget: geometric lengths of which `at_budget` reach T tokens."""
  return 1.0 - at_budget ** (1.0 / (new_tokens - 1))


def make_trainer(slots: int, args, out_dir: str, vocab: int | None = None):
  from rljax.config_overrides import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py"))
  apply_overrides(cfg, [
      f"output.dir={out_dir!r}", "checkpoint.resume=False", f"train.steps={args.steps + 1}",
      f"train.prompts_per_step={PROMPTS}", f"sampling.num_samples={GROUP}", f"sampling.slots={slots}",
      f"sampling.max_new_tokens={args.new_tokens}", f"model.random.hidden_size={args.hidden}",
      f"model.random.intermediate_size={4 * args.hidden}", f"model.random.num_layers={args.layers}",
      "model.random.head_dim=32", "model.random.num_heads=4", "optim.learning_rate=0.01",
      "output.tensorboard=False", "output.progress=False"])
  if vocab is not None:
    n_stop = round(stop_fraction(args.new_tokens, args.at_budget) * vocab)
    cfg.sampling.stop_token_ids = list(range(100, 100 + n_stop))
  return Trainer(cfg)


def model_config(args):
  from rljax.models.config import ModelConfig
  return ModelConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                     num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048)


def run_sampler(args) -> dict[int, dict]:
  """The sampler alone: every side on the same prompts and keys, runs interleaved."""
  import jax
  import numpy as np

  from rljax.models.policy import init_params
  from rljax.rollout import SamplingParams, sample
  config = model_config(args)
  params = init_params(config, jax.random.key(0))
  rng = np.random.default_rng(0)
  lengths = rng.integers(20, 48, PROMPTS)
  ids, mask = np.zeros((PROMPTS, 48), np.int32), np.zeros((PROMPTS, 48), bool)
  for i, n in enumerate(lengths):
    ids[i, 48 - n:], mask[i, 48 - n:] = rng.integers(20000, VOCAB, n), True
  stops = tuple(range(100, 100 + round(stop_fraction(args.new_tokens, args.at_budget) * VOCAB)))
  f = jax.jit(sample, static_argnames=("config", "sp", "eos_ids"))
  sides = [int(x) for x in args.slots.split(",")]
  compiled = {}
  for s in sides:
    sp = SamplingParams(num_samples=GROUP, max_new_tokens=args.new_tokens, temperature=1.0, slots=s,
                        stop_token_ids=stops)
    compiled[s] = f.lower(config, params, ids, mask, sp, jax.random.key(0)).compile()
  runs: dict[int, list] = {s: [] for s in sides}
  for rep in range(args.reps + 1):
    key = jax.random.key(rep)
    for s in sides:
      start = time.perf_counter()
      out = jax.device_get(compiled[s](params, ids, mask, key))
      runs[s].append((time.perf_counter() - start, out))
  results = {}
  for s in sides:
    timed = runs[s][1:]   # the first round warms up
    for (_, out), (_, ref) in zip(runs[s], runs[sides[0]]):
      if not np.array_equal(out.tokens, ref.tokens):
        raise SystemExit(f"slots={s} drew other tokens than slots={sides[0]}: the sampler is not exact")
    n = s or PROMPTS * GROUP
    steps = [float(out.decode_step.max()) for _, out in timed]
    decoded = [float(np.maximum(out.lengths - 1, 0).sum()) for _, out in timed]
    results[s] = {"slots": n, "decode_steps": statistics.mean(steps),
                  "utilisation": statistics.mean(d / (n * k) for d, k in zip(decoded, steps)),
                  "length": statistics.mean(float(out.lengths.mean()) for _, out in timed),
                  "longest": statistics.mean(float(out.lengths.max()) for _, out in timed),
                  "seconds": statistics.median(t for t, _ in timed)}
  return results


def run_train(args) -> dict[int, dict]:
  sides = [int(s) for s in args.slots.split(",")]
  with tempfile.TemporaryDirectory() as work:
    probe = make_trainer(0, args, os.path.join(work, "probe"))   # the vocabulary size is known once loaded
    vocab = probe.tokenizer.vocab_size
    probe.close()
    trainers = {s: make_trainer(s, args, os.path.join(work, f"slots{s}"), vocab) for s in sides}
    metrics: dict[int, list] = {s: [] for s in sides}
    seconds: dict[int, list] = {s: [] for s in sides}
    try:
      for _ in range(args.steps + 1):
        for s in sides:
          start = time.perf_counter()
          metrics[s].append(trainers[s].run_step())
          seconds[s].append(time.perf_counter() - start)
    finally:
      for t in trainers.values():
        t.close()
  # The first batch is sampled with the same parameters on every side, so it must be the same; later
  # ones follow updates whose inputs (the sampler's log-probs) differ in the last bits between sides.
  tokens = {s: [m["sampler/tokens"] for m in metrics[s]] for s in sides}
  if any(tokens[s][0] != tokens[sides[0]][0] for s in sides):
    raise SystemExit(f"the sides drew different samples (tokens per step {tokens}): the sampler is not exact")
  out = {}
  for s in sides:
    timed = metrics[s][1:]
    mean = lambda key, timed=timed: statistics.mean(m[key] for m in timed)
    out[s] = {"slots": s or PROMPTS * GROUP, "decode_steps": mean("sampler/decode_steps"),
              "utilisation": mean("sampler/slot_utilisation"), "length": mean("response_length_mean"),
              "longest": mean("response_length_max"), "seconds": statistics.median(seconds[s][1:]),
              "sample_s": statistics.median(m.get("time/sample", float("nan")) for m in timed)}
  return out


def memory(args) -> list[tuple[int, int, float]]:
  """Compiled temporary memory of the sampler (no run) at SmolLM2-135M's shapes, P=8 x G=8."""
  import jax
  import jax.numpy as jnp

  from rljax.models.config import ModelConfig
  from rljax.models.policy import init_params
  from rljax.rollout import SamplingParams, sample
  config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
  params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  ids = jax.ShapeDtypeStruct((PROMPTS, args.memory_prompt), jnp.int32)
  mask = jax.ShapeDtypeStruct((PROMPTS, args.memory_prompt), bool)
  rows = []
  f = jax.jit(sample, static_argnames=("config", "sp", "eos_ids"))
  for s in [int(x) for x in args.slots.split(",")]:
    sp = SamplingParams(num_samples=GROUP, max_new_tokens=args.memory_tokens, slots=s)
    stats = f.lower(config, params, ids, mask, sp, jax.random.key(0), eos_ids=(2,)).compile().memory_analysis()
    per_row = 2 * config.num_layers * config.num_kv_heads * config.head_dim * args.memory_tokens * 4   # float32 k, v
    cache = per_row * (s or PROMPTS * GROUP)
    rows.append((s or PROMPTS * GROUP, stats.temp_size_in_bytes, cache / 2**20))
  return rows


def compare(res: dict[int, dict], what: str, work: str) -> list[Result]:
  sides = list(res.values())
  base = sides[0]
  for r in sides:
    print(f"{what}, slots {r['slots']:>3}: {r['decode_steps']:6.1f} decode steps  utilisation {r['utilisation']:5.1%}  "
          f"{r['seconds']:6.2f} s" + (f" (sample {r['sample_s']:.2f} s)" if "sample_s" in r else "")
          + f"  mean length {r['length']:.1f}, longest {r['longest']:.0f}")
  out = []
  for r in sides[1:]:
    head = f"{work}, slots={r['slots']} vs {base['slots']}"
    out.append(Result(f"{head}: decode steps per batch (slot utilisation)",
                      f"{r['decode_steps']:.1f} ({r['utilisation']:.0%})",
                      f"slots={base['slots']}: {base['decode_steps']:.1f} ({base['utilisation']:.0%})",
                      f"{r['decode_steps'] / base['decode_steps']:.2f}x the steps"))
    out.append(Result(f"{head}: {what}, seconds per batch on this CPU", f"{r['seconds']:.2f}",
                      f"slots={base['slots']}: {base['seconds']:.2f}", f"{base['seconds'] / r['seconds']:.2f}x faster"))
    if "sample_s" in r:
      out.append(Result(f"{head}: {what}, its sample phase (seconds)", f"{r['sample_s']:.2f}",
                        f"slots={base['slots']}: {base['sample_s']:.2f}",
                        f"{base['sample_s'] / r['sample_s']:.2f}x faster"))
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--slots", default="0,32,16", help="comma-separated sampling.slots values (0 = one per row)")
  p.add_argument("--reps", type=int, default=4, help="timed generations per side (after one warm-up round)")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--at-budget", type=float, default=0.03, help="share of completions that reach the budget")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--train", action="store_true", help="also train the smoke task, fused, per side")
  p.add_argument("--steps", type=int, default=3, help="with --train: measured steps per side (after one warm-up)")
  p.add_argument("--memory", action="store_true", help="also compile the sampler at SmolLM2-135M shapes (no run)")
  p.add_argument("--memory-tokens", type=int, default=512)
  p.add_argument("--memory-prompt", type=int, default=64)
  add_json_arg(p)
  args = p.parse_args()
  logging.basicConfig(level=logging.WARNING)
  print(machine())
  frac = stop_fraction(args.new_tokens, args.at_budget)
  print(f"stop ids: {frac:.4f} of the vocabulary (geometric lengths, mean ~{1 / frac:.0f}, "
        f"{args.at_budget:.0%} at the {args.new_tokens}-token budget)")
  work = f"{PROMPTS}x{GROUP} rows, {args.new_tokens}-token budget, geometric lengths"
  results = compare(run_sampler(args), "generation", work)
  if args.train:
    results += compare(run_train(args), "fused train step", work)
  if args.memory:
    mem = memory(args)
    for slots, temp, cache in mem:
      print(f"SmolLM2-135M sampler, P={PROMPTS} x G={GROUP}, {args.memory_prompt}-token prompts, "
            f"{args.memory_tokens} new tokens, slots {slots:>3}: compiled temp {temp / 2**20:8.1f} MiB "
            f"(completion KV cache {cache:6.1f} MiB)")
    (s0, t0, _), rest = mem[0], mem[1:]
    results += [Result(f"sampler temp memory (SmolLM2-135M, {args.memory_tokens} tokens), slots={s} vs {s0}",
                       f"{t / 2**20:.0f} MiB", f"{t0 / 2**20:.0f} MiB", f"{t / t0:.2f}x") for s, t, _ in rest]
  report(results, args.json)


if __name__ == "__main__":
  main()
