"""Deviceless v5p compile of the evaluation sampler (SmolLM2-135M, 128 prompts x 48, 16 new tokens,
greedy): the plain prefill against the shared-prefix prefill (s = 27, the default recipe's system
prompt): per-chip memory and FLOPs from the TPU compiler, no TPU needed (`pip install 'rljax[tpu]'`).

  JAX_PLATFORMS=cpu python scripts/plan_eval_sampler.py
"""
import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

import rljax
from rljax.plan.topology import parse_topology
from rljax.rollout import SamplingParams
from rljax.rollout.sampler import sample

topo = parse_topology("v5p:2x2x1")
dev = topo.devices()[0]
policy = rljax.load_pretrained("smollm2-135m-instruct")
cfg = policy.config
sh = SingleDeviceSharding(dev)
params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), policy.params)
ids = jax.ShapeDtypeStruct((128, 48), jnp.int32, sharding=sh)
mask = jax.ShapeDtypeStruct((128, 48), jnp.bool_, sharding=sh)
key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sh)
sp = SamplingParams(num_samples=1, max_new_tokens=16, greedy=True, stop_token_ids=(2,))
for s in (0, 27):
  f = jax.jit(lambda p, i, m, k, s=s: sample(cfg, p, i, m, sp, k, (2,), shared_prefix=s))
  c = f.lower(params, ids, mask, key).compile()
  ma = c.memory_analysis()
  flops = (c.cost_analysis() or {}).get("flops", 0)
  mib = lambda b: f"{b / 2**20:.1f} MiB"   # noqa: E731
  print(f"shared_prefix={s}: temp {mib(ma.temp_size_in_bytes)}, args {mib(ma.argument_size_in_bytes)}, "
        f"out {mib(ma.output_size_in_bytes)}, peak {mib(getattr(ma, 'peak_memory_in_bytes', 0))}, "
        f"flops {flops / 1e9:.1f} G", flush=True)
