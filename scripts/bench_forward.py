"""Forward-pass throughput of a policy, and the fraction of this machine's matmul peak it reaches.

    python scripts/bench_forward.py                     # SmolLM2-135M, batch 16 x 128, float32
    python scripts/bench_forward.py --dtype bfloat16 --batch 8 --length 256

Reports (median of --iters timed runs, compilation and one warm-up run excluded):
  * the machine's measured matmul rate: a jitted jnp.matmul of --peak-size^3 in the same dtype;
  * forward tokens/s and achieved FLOP/s, with FLOPs = 2 * (matmul parameters) * tokens + attention
    (4 * B * T^2 * H * Dh per layer: QK^T and PV over the full T x T score matrix, which is what the
    implementation computes), and the fraction of the measured peak.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchlib import Result, add_json_arg, report  # noqa: E402

from rljax.flops import forward_flops, matmul_peak, timed  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="smollm2-135m-instruct", help="HF dir, .gguf file or built-in name")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--length", type=int, default=128)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--peak-size", type=int, default=2048)
  add_json_arg(p)
  args = p.parse_args(argv)

  from rljax.models.io import load_pretrained

  dtype = jnp.dtype(args.dtype)
  peak = matmul_peak(args.peak_size, dtype, args.iters)

  policy = load_pretrained(args.model, dtype=args.dtype, param_dtype=args.dtype, tokenizer=False)
  c = policy.config
  rng = np.random.RandomState(0)
  ids = jnp.asarray(rng.randint(0, c.vocab_size, (args.batch, args.length)), jnp.int32)
  mask = jnp.ones(ids.shape, bool)
  start = time.perf_counter()
  policy(ids, mask).block_until_ready()
  compile_s = time.perf_counter() - start
  seconds = timed(lambda: policy(ids, mask).block_until_ready(), args.iters)

  tokens = args.batch * args.length
  mm = forward_flops(c, tokens, context=0)
  attn = forward_flops(c, tokens, context=args.length) - mm  # the full T x T score matrix is computed
  achieved = (mm + attn) / seconds
  dev = jax.devices()[0]
  rows = [
      ("device", f"{dev.platform} ({dev.device_kind}), {jax.device_count()} device(s), {os.cpu_count()} CPU cores"),
      ("model", f"{args.model}: {c.num_params / 1e6:.1f}M params, {c.num_layers} layers, d={c.hidden_size}"),
      ("shape / dtype", f"batch {args.batch} x {args.length} tokens, {args.dtype}"),
      (f"matmul peak ({args.peak_size}^3)", f"{peak / 1e9:.1f} GFLOP/s"),
      ("first call (compile + run)", f"{compile_s:.2f} s"),
      (f"forward (median of {args.iters})", f"{seconds * 1e3:.1f} ms"),
      ("throughput", f"{tokens / seconds:,.0f} tokens/s"),
      ("FLOPs / forward", f"{(mm + attn) / 1e9:.1f} G (matmuls {mm / 1e9:.1f} G + attention {attn / 1e9:.2f} G)"),
      ("achieved", f"{achieved / 1e9:.1f} GFLOP/s"),
      ("fraction of measured peak", f"{achieved / peak:.1%}"),
  ]
  width = max(len(k) for k, _ in rows)
  print("-" * (width + 50))
  for k, v in rows:
    print(f"{k:<{width}}  {v}")
  print("-" * (width + 50))
  work = f"forward, batch {args.batch} x {args.length}, {args.dtype}"
  return report([Result(f"{work}: tokens/s", f"{tokens / seconds:,.0f}"),
                 Result(f"{work}: fraction of measured matmul peak ({peak / 1e9:.0f} GFLOP/s)",
                        f"{achieved / peak:.0%}")],
                args.json)


if __name__ == "__main__":
  main()
