"""Peak temporary memory of per-token log-probs + entropy (forward and value-and-grad):
the naive full fp32 log-softmax vs rljax.rl.chunked_logprobs.

Nothing is executed: each program is compiled for the shapes below and XLA's own memory
analysis of the compiled executable is reported (`compiled.memory_analysis()`), so the 4.9 GB
naive case can be measured on a small machine.

  python scripts/bench_logprobs_memory.py                 # B=8, T=1024, D=896, V=150000
  python scripts/bench_logprobs_memory.py --vocab 151936 --dim 1536 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import Result, add_json_arg, report  # noqa: E402

from rljax.rl import chunked_logprobs, naive_logprobs  # noqa: E402

GIB = 1024**3


def _programs(chunk_size: int):
  """name -> function(hidden, lm_head, targets) for the four measured programs."""
  def fwd(fn):
    return lambda h, w, y: fn(h, w, y)

  def grad(fn):
    def loss(h, w, y):
      lp, ent = fn(h, w, y)
      return jnp.sum(lp) + 0.01 * jnp.sum(ent)
    return jax.value_and_grad(loss, argnums=(0, 1))

  chunked = lambda h, w, y: chunked_logprobs(h, w, y, chunk_size=chunk_size)
  return {
      "naive forward": fwd(naive_logprobs),
      "chunked forward": fwd(chunked),
      "naive value+grad": grad(naive_logprobs),
      "chunked value+grad": grad(chunked),
  }


def measure(batch: int, length: int, dim: int, vocab: int, dtype: str, chunk_size: int):
  """Returns {program name: memory_analysis of its compiled executable}."""
  hidden = jax.ShapeDtypeStruct((batch, length, dim), jnp.dtype(dtype))
  lm_head = jax.ShapeDtypeStruct((dim, vocab), jnp.dtype(dtype))
  targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  out = {}
  for name, fn in _programs(chunk_size).items():
    out[name] = jax.jit(fn).lower(hidden, lm_head, targets).compile().memory_analysis()
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=1024)
  parser.add_argument("--dim", type=int, default=896)
  parser.add_argument("--vocab", type=int, default=150_000)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--chunk-size", type=int, default=4096)
  add_json_arg(parser)
  args = parser.parse_args(argv)

  n = args.batch * args.length
  print(f"backend={jax.default_backend()} B={args.batch} T={args.length} D={args.dim} "
        f"V={args.vocab} dtype={args.dtype} chunk={args.chunk_size}")
  print(f"one [B*T, V] fp32 array = {n * args.vocab * 4 / GIB:.2f} GiB; "
        f"one [B*T, chunk] fp32 array = {n * args.chunk_size * 4 / GIB:.3f} GiB")
  stats = measure(args.batch, args.length, args.dim, args.vocab, args.dtype, args.chunk_size)
  print(f"{'program':<20} {'temp GiB':>9} {'args GiB':>9} {'out GiB':>9}")
  for name, mem in stats.items():
    print(f"{name:<20} {mem.temp_size_in_bytes / GIB:9.3f} {mem.argument_size_in_bytes / GIB:9.3f} "
          f"{mem.output_size_in_bytes / GIB:9.3f}")
  results = []
  for kind in ("forward", "value+grad"):
    naive = stats[f"naive {kind}"].temp_size_in_bytes
    chunked = stats[f"chunked {kind}"].temp_size_in_bytes
    print(f"{kind}: temp memory saved {(naive - chunked) / GIB:.2f} GiB "
          f"({naive / max(chunked, 1):.1f}x less)")
    results.append(Result(f"log-prob {kind}, B={args.batch} T={args.length} V={args.vocab}: temporaries",
                          f"{chunked / GIB:.3f} GiB (chunked)", f"{naive / GIB:.1f} GiB (naive [B, T, V])",
                          f"{naive / max(chunked, 1):.0f}x less"))
  return report(results, args.json)


if __name__ == "__main__":
  main()
