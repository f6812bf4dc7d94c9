"""FLOP counts of the policy's work, and the device's peak rate to compare them with.

Counts are model FLOPs of the matmuls and attention (2 per multiply-add), the convention behind
"MFU": element-wise work (norms, softmax, RoPE) is left out, and padded tokens count because the
device computes them.
"""
from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets, by a substring of
# `jax.Device.device_kind` (lower-case). fp32 work on TPUs runs through bf16 passes; on GPUs
# TF32 tensor cores run at half these rates.
_PEAK_BF16 = (
    ("v6", 918e12), ("v5p", 459e12), ("v5 lite", 197e12), ("v5e", 197e12), ("v4", 275e12),
    ("h200", 989e12), ("h100", 989e12), ("a100", 312e12), ("l4", 121e12),
)


def forward_flops(config, tokens: int, context: float) -> float:
  """FLOPs of one forward over `tokens` tokens whose attention spans `context` keys on average."""
  c = config
  per_layer = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
  matmul_params = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + the output projection
  attention = 4 * context * c.num_heads * c.head_dim * c.num_layers      # q.k and p.v per token
  return float(tokens) * (2.0 * matmul_params + attention)


def rollout_step_flops(config, *, sample_prompts: int, update_prompts: int, group: int, prompt_len: int,
                       decode_steps: int, completion_len: int, epochs: int = 1,
                       extra_forwards: int = 0) -> dict[str, float]:
  """FLOPs of one generate-score-update step, by phase.

  sample: one prefill per prompt ([sample_prompts, prompt_len]), then `decode_steps` tokens for
  each of sample_prompts * group rows. update: forward + backward (3 forwards) over
  [update_prompts * group, prompt_len + completion_len] per epoch, plus `extra_forwards` forwards
  (a reference model, recomputed old log-probs). The two prompt counts differ under dynamic
  sampling, which generates for more prompts than it trains on.
  """
  prefill = forward_flops(config, sample_prompts * prompt_len, prompt_len / 2)
  decode = forward_flops(config, sample_prompts * group * decode_steps, prompt_len + decode_steps / 2)
  seq = prompt_len + completion_len
  update_forward = forward_flops(config, update_prompts * group * seq, seq / 2)
  return {"sample": prefill + decode, "update": (3 * epochs + extra_forwards) * update_forward}


def timed(fn, iters: int, reduce=statistics.median) -> float:
  """Seconds of `fn()` (which must block until done): `reduce` over `iters` runs after a warm-up."""
  fn()
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return reduce(times)


def matmul_peak(size: int = 1024, dtype=jnp.float32, iters: int = 5, device=None,
                reduce=statistics.median) -> float:
  """Measured FLOP/s of a jitted [size, size] @ [size, size] matmul on one device.

  `reduce` picks the time from `iters` runs: the median (default) or `min` for the best rate.
  """
  device = device or jax.local_devices()[0]
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(k1, (size, size), dtype), device)
  b = jax.device_put(jax.random.normal(k2, (size, size), dtype), device)
  f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=dtype))
  return 2 * size**3 / timed(lambda: f(a, b).block_until_ready(), iters, reduce)


@functools.cache
def device_peak_flops(dtype_name: str = "float32") -> tuple[float, str]:
  """(peak FLOP/s of all devices together, where the figure comes from).

  Accelerators: the spec-sheet dense bf16 rate per chip (half of it for float32 on GPUs). CPUs
  and unknown devices: a measured matmul on one local device; simulated CPU devices share their
  host's cores, so a CPU's rate is counted once per process (host), not per device.
  """
  devices = jax.devices()
  kind = devices[0].device_kind.lower()
  if devices[0].platform != "cpu":
    for name, peak in _PEAK_BF16:
      if name in kind:
        scale = 0.5 if dtype_name == "float32" and devices[0].platform == "gpu" else 1.0
        return peak * scale * len(devices), f"spec sheet ({kind}, {len(devices)} chips)"
  peak = matmul_peak(dtype=jnp.dtype(dtype_name))
  count = jax.process_count() if devices[0].platform == "cpu" else len(devices)
  return peak * count, f"measured 1024^3 {dtype_name} matmul ({kind})"
