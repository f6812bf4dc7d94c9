"""Memory and time of one attention layer, forward + backward, per backend and sequence length.

The layer is `rljax.models.attention.attend` (scores, softmax, output: what grows with T) with
Qwen2.5-7B shapes: 28 query heads, 4 KV heads, head dim 128, batch 1, no padding. The program
is `jit(value_and_grad(sum(attend(q, k, v) * w)))` w.r.t. q, k, v. Memory is XLA's own analysis of
the compiled executable (`memory_analysis().temp_size_in_bytes`: buffers besides the arguments
and outputs), so a program too big for this machine is still measured; wall time is measured
where the temporaries fit under --max-run-gib.

  python scripts/bench_attention.py                                  # CPU: xla and chunked, 1k-32k
  python scripts/bench_attention.py --lengths 1024,4096 --impls chunked
  python scripts/bench_attention.py --tpu                            # + deviceless TPU v5p compile

`--tpu` compiles the same program for a TPU topology without a TPU (libtpu must be installed,
`pip install libtpu==0.0.42.1` for jax 0.10.2), on a rljax (data, fsdp, tensor) mesh of its
devices, under the mesh context as the trainer traces (`rljax.sharding.activate`), for chunked
and splash at --tpu-lengths, and reports the per-device temporaries.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import Result, add_json_arg, machine, report  # noqa: E402

from rljax import sharding as shd  # noqa: E402
from rljax.models.attention import attend  # noqa: E402

GIB = 1024**3
HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128   # Qwen2.5-7B


def shapes(length: int, dtype, sharding=None):
  """ShapeDtypeStructs of q [1, T, K, R, Dh], k, v [1, T, K, Dh] and the weight w like q."""
  r = HEADS // KV_HEADS
  q = jax.ShapeDtypeStruct((1, length, KV_HEADS, r, HEAD_DIM), dtype, sharding=sharding)
  kv = jax.ShapeDtypeStruct((1, length, KV_HEADS, HEAD_DIM), dtype, sharding=sharding)
  return q, kv, kv, q


def program(impl: str, block: int, interpret: bool | None = None):
  """value_and_grad of sum(attend(q, k, v) * w) w.r.t. q, k, v."""
  def loss(q, k, v, w):
    out = attend(q, k, v, impl=impl, block_q=block, block_k=block, interpret=interpret)
    return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def run_cpu(args) -> list[Result]:
  dtype = jnp.dtype(args.dtype)
  rows, results, xla = [], [], {}
  for length in args.lengths:
    for impl in args.impls:
      t0 = time.perf_counter()
      compiled = program(impl, args.block).lower(*shapes(length, dtype)).compile()
      compile_s = time.perf_counter() - t0
      temp = compiled.memory_analysis().temp_size_in_bytes / GIB
      wall = None
      if temp <= args.max_run_gib and length <= args.max_run_tokens:
        rng = np.random.default_rng(0)
        inputs = [jnp.asarray(rng.standard_normal(s.shape, np.float32), dtype) for s in shapes(length, dtype)]
        repeats = args.repeats if length <= 4096 else 1
        times = []
        for _ in range(repeats):
          t0 = time.perf_counter()
          jax.block_until_ready(compiled(*inputs))
          times.append(time.perf_counter() - t0)
        wall = min(times)
        del inputs
      rows.append((impl, length, temp, wall, compile_s))
      print(f"  {impl:8s} T={length:6d}: temp {temp:8.2f} GiB, "
            f"{'-' if wall is None else f'{wall:.2f} s'}, compile {compile_s:.1f} s", flush=True)
      if impl == "xla":
        xla[length] = (temp, wall)
  print(f"\nOne attention layer fwd+bwd, {args.dtype}, B=1, H=28, K=4, Dh=128, block {args.block}; {machine()}")
  print("| backend | T | temporaries (GiB) | wall (s) |\n| --- | --- | --- | --- |")
  for impl, length, temp, wall, _ in rows:
    print(f"| {impl} | {length} | {temp:.2f} | {'-' if wall is None else f'{wall:.2f}'} |")
  print()
  for impl, length, temp, wall, _ in rows:
    if impl == "xla":
      continue
    ref = xla.get(length)
    fmt = lambda t, w: f"{t:.2f} GiB" + ("" if w is None else f", {w:.2f} s")
    results.append(Result(f"attention fwd+bwd {impl} T={length} (cpu, {args.dtype})", fmt(temp, wall),
                          "-" if ref is None else "xla: " + fmt(*ref),
                          "-" if ref is None else f"{ref[0] / max(temp, 1e-9):.0f}x less memory"))
  return results


def run_tpu(args) -> list[Result]:
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name=args.tpu_topology, platform="tpu")
  devices = list(topo.devices)
  mesh = shd.make_mesh(args.tpu_mesh, devices)
  sharding = jax.sharding.NamedSharding(mesh, shd.logical_to_spec(
      ("batch", "length", "kv_heads"), (1, 1, KV_HEADS), mesh))
  dtype = jnp.dtype(args.dtype)
  print(f"\nDeviceless compile for {args.tpu_topology} ({len(devices)} {devices[0].device_kind} devices), mesh "
        f"(data, fsdp, tensor) = {tuple(mesh.shape.values())}, inputs {sharding.spec}; per-device temporaries:")
  print("| backend | T | temporaries per device (GiB) |\n| --- | --- | --- |")
  results = []
  for length in args.tpu_lengths:
    for impl in args.tpu_impls:
      with shd.activate(mesh):
        lowered = program(impl, args.block, interpret=False if impl == "splash" else None).lower(
            *shapes(length, dtype, sharding))
      temp = lowered.compile().memory_analysis().temp_size_in_bytes / GIB
      print(f"| {impl} | {length} | {temp:.2f} |", flush=True)
      results.append(Result(f"attention fwd+bwd {impl} T={length} ({args.tpu_topology}, deviceless, {args.dtype})",
                            f"{temp:.2f} GiB temp per device"))
  return results


def _ints(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", type=_ints, default=[1024, 4096, 16384, 32768])
  p.add_argument("--impls", type=lambda s: s.split(","), default=["xla", "chunked"])
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--block", type=int, default=512, help="chunked / splash block size")
  p.add_argument("--max-run-gib", type=float, default=5.0, help="run (time) only programs with fewer temporaries")
  p.add_argument("--max-run-tokens", type=int, default=16384, help="run (time) only up to this length")
  p.add_argument("--repeats", type=int, default=2, help="timed runs (best of) up to 4k tokens; 1 above")
  p.add_argument("--tpu", action="store_true", help="also compile deviceless for a TPU topology")
  p.add_argument("--tpu-topology", default="v5p:2x2x2")
  p.add_argument("--tpu-mesh", type=_ints, default=[-1, 1, 1], help="(data, fsdp, tensor); -1 fills")
  p.add_argument("--tpu-lengths", type=_ints, default=[16384, 32768])
  p.add_argument("--tpu-impls", type=lambda s: s.split(","), default=["chunked", "splash"])
  p.add_argument("--skip-cpu", action="store_true")
  add_json_arg(p)
  args = p.parse_args()
  results = [] if args.skip_cpu else run_cpu(args)
  if args.tpu:
    results += run_tpu(args)
  report(results, args.json)


if __name__ == "__main__":
  main()
