"""Benchmark: one decode step's token draw (`rljax.rollout.sample_logits`) against the textbook JAX
draw measured in the same run, on [B, V] float32 logits of SmolLM2's vocabulary (V = 49152).

The textbook draw is what a JAX sampler usually writes: `jnp.argmax` for greedy, a full sort of
each row with a cumulative sum for top-p, `jax.lax.top_k` for top-k, then
`jax.random.categorical` (the log-prob and entropy of the row come from `jax.nn.log_softmax`).
rljax's draw computes the same figures; its tokens differ only in which random numbers pick
them (a two-level Gumbel draw), so the sampled rows are not compared, the greedy ones are.

  python scripts/bench_draw.py [--rows 128] [--repeats 20]

Reports rows of the benchmarks' table (`benchlib`): per-draw median milliseconds of each side.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchlib import Result, add_json_arg, report  # noqa: E402

from rljax.rollout import SamplingParams, sample_logits  # noqa: E402

VOCAB = 49152


def textbook_draw(logits, sp: SamplingParams, key):
  """tokens [B], log-probs [B], entropy [B] the common way (see the module docstring)."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  if sp.is_greedy:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    masked = logits
    if sp.top_k:
      kth = jax.lax.top_k(logits, sp.top_k)[0][:, -1:]
      masked = jnp.where(logits >= kth, masked, -jnp.inf)
    if sp.top_p < 1.0:
      order = jnp.sort(masked, axis=-1)[:, ::-1]
      probs = jax.nn.softmax(order, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs
      cut = jnp.take_along_axis(order, jnp.maximum(jnp.sum(before < sp.top_p, -1) - 1, 0)[:, None], -1)
      masked = jnp.where(masked >= cut, masked, -jnp.inf)
    tokens = jax.random.categorical(key, masked, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0], entropy


def median_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=20)
  add_json_arg(parser)
  args = parser.parse_args()
  logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (args.rows, VOCAB)), jnp.float32)
  key = jax.random.key(0)
  cases = [("greedy", {"greedy": True}), ("temperature 1", {}), ("top_p 0.9", {"top_p": 0.9}),
           ("top_k 50", {"top_k": 50}), ("top_k 50, top_p 0.9", {"top_k": 50, "top_p": 0.9})]
  results = []
  for name, kw in cases:
    sp = SamplingParams(num_samples=1, max_new_tokens=1, **kw)
    ours = jax.jit(lambda x, k, sp=sp: sample_logits(x, sp, k))
    theirs = jax.jit(lambda x, k, sp=sp: textbook_draw(x, sp, k))
    if sp.is_greedy:   # the same tokens
      np.testing.assert_array_equal(np.asarray(ours(logits, key)[0]), np.asarray(theirs(logits, key)[0]))
    a, b = median_ms(ours, logits, key, repeats=args.repeats), median_ms(theirs, logits, key, repeats=args.repeats)
    results.append(Result(f"token draw, {name}, {args.rows} x {VOCAB} logits: ms per draw (peer: textbook JAX)",
                          f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x faster"))
  report(results, args.json)

if __name__ == "__main__":
  main()
