"""FLOP counts of the policy's work, and the device's peak rate to compare them with.

Counts are model FLOPs of the matmuls and attention (2 per multiply-add), the convention behind
"MFU": element-wise work (norms, softmax, RoPE) is left out, and padded tokens count because the
device computes them.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from rljax.models import families

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets, by a substring of
# `jax.Device.device_kind` (lower-case). fp32 work on TPUs runs through bf16 passes; on GPUs
# TF32 tensor cores run at half these rates.
_PEAK_BF16 = (
    ("v6", 918e12), ("v5p", 459e12), ("v5 lite", 197e12), ("v5e", 197e12), ("v4", 275e12),
    ("h200", 989e12), ("h100", 989e12), ("a100", 312e12), ("l4", 121e12),
)
_GPUS = ("h200", "h100", "a100", "l4")


def spec_peak(kind: str, dtype_name: str) -> tuple[str, float] | None:
  """(the table's name, dense peak FLOP/s per chip) from the spec sheets, for a device kind that
  contains a known name (None: not known). float32 on GPUs runs through TF32 at half the bf16 rate."""
  kind = kind.lower()
  for name, peak in _PEAK_BF16:
    if name in kind:
      return name, peak * (0.5 if dtype_name == "float32" and name in _GPUS else 1.0)
  return None


def _weight_matmul_flops(config, tokens: int) -> float:
  """FLOPs of the forward's weight matmuls (projections, MLP or experts, output head) over `tokens`
  tokens, as the model's family counts them (active parameters only for a mixture of experts)."""
  return float(tokens) * families.get(config.architecture).weight_flops_per_token(config)


def forward_flops(config, tokens: int, context: float) -> float:
  """FLOPs of one forward over `tokens` tokens whose attention spans `context` keys on average
  (LoRA adapters included)."""
  family = families.get(config.architecture)
  per_token = (family.weight_flops_per_token(config) + family.attention_flops_per_token(config, context)
               + family.adapter_flops_per_token(config))
  return float(tokens) * per_token


def train_flops(config, tokens: int, context: float) -> float:
  """FLOPs of forward + backward: 3 forwards, less the weight gradients of frozen weights under
  LoRA (the base's matmuls need gradients for their inputs only: 2 forwards' worth)."""
  frozen = _weight_matmul_flops(config, tokens) if getattr(config, "lora", None) is not None else 0.0
  return 3 * forward_flops(config, tokens, context) - frozen


def rollout_step_flops(config, *, sample_prompts: int, update_prompts: int, group: int, prompt_len: int,
                       decode_steps: int, completion_len: int, epochs: int = 1,
                       extra_forwards: int = 0, decode_rows: int | None = None, update_fraction: float = 1.0,
                       extra_fraction: float = 1.0) -> dict[str, float]:
  """FLOPs of one generate-score-update step, by phase.

  sample: one prefill per prompt ([sample_prompts, prompt_len]), then `decode_steps` tokens for
  each of `decode_rows` rows (default sample_prompts * group, one per sample; fewer with the
  sampler's decode slots, sampling.slots). update: forward + backward (`train_flops`) over
  [update_prompts * group, prompt_len + completion_len] per epoch, plus `extra_forwards` forwards
  (a reference model, recomputed old log-probs). The two prompt counts differ under dynamic
  sampling, which generates for more prompts than it trains on. A packed or shared-prefix update
  computes fewer positions than those padded rows: `update_fraction` (and `extra_fraction` for
  the extra forwards) is the share it computes (the step's packed_tokens / padded_tokens).
  """
  prefill = forward_flops(config, sample_prompts * prompt_len, prompt_len / 2)
  rows = sample_prompts * group if decode_rows is None else decode_rows
  decode = forward_flops(config, rows * decode_steps, prompt_len + decode_steps / 2)
  seq = prompt_len + completion_len
  tokens = update_prompts * group * seq
  update = (epochs * update_fraction * train_flops(config, tokens, seq / 2)
            + extra_forwards * extra_fraction * forward_flops(config, tokens, seq / 2))
  return {"sample": prefill + decode, "update": update}


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


def matmul_rates(size: int = 1024, dtype=jnp.float32, rounds: int = 8, device=None,
                 min_round_s: float = 0.025) -> tuple[float, float]:
  """(best wall-clock rate, CPU-time rate) in FLOP/s of a jitted [size, size] @ [size, size] matmul.

  The CPU-time rate is FLOPs over this process's CPU seconds, times the cores it may use: the
  rate the matmul runs at while it has the cores. Other processes on a busy machine take wall time
  from it, not CPU time, so this rate holds up under load where the wall-clock one falls (2 cores,
  load 11: 21-28 GFLOP/s by the wall clock, 153-197 by CPU time, 211 measured quiet). Each of
  `rounds` rounds runs back-to-back matmuls for at least `min_round_s`; see `rates_from_rounds`
  for how the rounds are reduced.
  """
  device = device or jax.local_devices()[0]
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(k1, (size, size), dtype), device)
  b = jax.device_put(jax.random.normal(k2, (size, size), dtype), device)
  f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=dtype))
  f(a, b).block_until_ready()
  start = time.perf_counter()
  f(a, b).block_until_ready()
  reps = max(1, math.ceil(min_round_s / max(time.perf_counter() - start, 1e-6)))
  try:
    cores = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    cores = os.cpu_count() or 1
  walls, cpus = [], []
  for _ in range(rounds):
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
      out = f(a, b)
    out.block_until_ready()
    walls.append((time.perf_counter() - w0) / reps)
    cpus.append((time.process_time() - c0) / reps)
  return rates_from_rounds(2 * size**3, walls, cpus, cores)


def rates_from_rounds(flop: float, walls, cpus, cores: int) -> tuple[float, float]:
  """(flop / the fastest round's wall seconds, flop * cores / the median round's CPU seconds).

  Load only ever slows a round by the wall clock, so the fastest is the machine's rate. CPU time
  can read low as well as high: a worker thread's latest slice may not be accounted yet when it is
  read (here one 1024^3 matmul in six read 5.4 ms of CPU for the usual 9.1 ms, and the minimum
  over ten once cached a 919 GFLOP/s "peak" for 2 cores that run 470 at most), so the median of
  rounds long enough to dwarf that lag is taken. Threads that spin while waiting count as CPU
  time, so on a busy machine this rate errs low.
  """
  return flop / max(min(walls), 1e-12), flop * cores / max(statistics.median(cpus), 1e-12)


PEAK_ENV = "RLJAX_PEAK_FLOPS"        # a peak FLOP/s (all devices together) to use instead of a figure found here
_CACHE_FILE = "peak_flops.json"
log = logging.getLogger(__name__)


def cache_dir() -> str:
  """Where rljax keeps small measured figures: $RLJAX_CACHE_DIR, else $XDG_CACHE_HOME/rljax, else ~/.cache/rljax."""
  if os.environ.get("RLJAX_CACHE_DIR"):
    return os.environ["RLJAX_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "rljax")


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _cache_key(kind: str, dtype_name: str) -> str:
  # "median": figures cached before rates_from_rounds took the median CPU time (some were twice
  # the machine's rate) are not reused.
  return f"{kind}|{_cpu_name()}|{os.cpu_count()} cores|{dtype_name}|jax {jax.__version__}|median"


def best_measured_peak(key: str, measured: float) -> float:
  """max(`measured`, the best figure cached under `key`), caching the result.

  A matmul timed while other work shares the cores reads low; the best figure seen on this
  machine is the closest to its real peak, so perf/mfu does not swing with the load at start-up.
  """
  path = os.path.join(cache_dir(), _CACHE_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      cached = json.load(f)
    if not isinstance(cached, dict):
      cached = {}
  except (OSError, ValueError):
    cached = {}
  old = cached.get(key)
  best = max(measured, float(old)) if isinstance(old, (int, float)) and math.isfinite(old) else measured
  if best != old:
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      cached[key] = best
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cached, f, indent=1, sort_keys=True)
      os.replace(tmp, path)
    except OSError as e:   # a read-only home: use the figure, keep nothing
      log.debug("could not cache the peak FLOP/s in %s: %s", path, e)
  return best


def utilization(flops_per_s: float, peak: float) -> float:
  """Achieved over peak FLOP/s, at most 1: a measured CPU peak can only be a lower bound, and a
  figure above 100% says nothing more than "at the peak"."""
  if not peak > 0 or not math.isfinite(flops_per_s):
    return 0.0
  return min(max(flops_per_s / peak, 0.0), 1.0)


@functools.cache
def device_peak_flops(dtype_name: str = "float32") -> tuple[float, str]:
  """(peak FLOP/s of all devices together, where the figure comes from).

  $RLJAX_PEAK_FLOPS, when set, wins. Accelerators: the spec-sheet dense bf16 rate per chip (half
  of it for float32 on GPUs). CPUs and unknown devices: the best rate of a 1024^3 matmul on one
  local device, timed now (by the wall clock or, on a CPU, by this process's CPU time, whichever
  is higher: `matmul_rates`) or on an earlier run on this machine (cached in
  `cache_dir()`, never lowered), whichever is higher; simulated CPU devices share their host's
  cores, so a CPU's rate is counted once per process (host), not per device. Timing by CPU time
  keeps a first measurement on a busy machine from caching a low peak (and MFU above 60% for
  steps the load had slowed).
  """
  if os.environ.get(PEAK_ENV):
    try:
      peak = float(os.environ[PEAK_ENV])
    except ValueError:
      peak = 0.0
    if peak > 0 and math.isfinite(peak):
      return peak, f"${PEAK_ENV}"
    log.warning("ignoring $%s=%r: expected a positive number of FLOP/s", PEAK_ENV, os.environ[PEAK_ENV])
  devices = jax.devices()
  kind = devices[0].device_kind.lower()
  known = spec_peak(kind, dtype_name) if devices[0].platform != "cpu" else None
  if known is not None:
    return known[1] * len(devices), f"spec sheet ({kind}, {len(devices)} chips)"
  wall, by_cpu = matmul_rates(dtype=jnp.dtype(dtype_name))
  measured = max(wall, by_cpu) if devices[0].platform == "cpu" else wall
  peak = best_measured_peak(_cache_key(f"{devices[0].platform}:{kind}", dtype_name), measured)
  count = jax.process_count() if devices[0].platform == "cpu" else len(devices)
  source = (f"best measured 1024^3 {dtype_name} matmul ({kind}; now {wall:.3g} by the wall clock, {by_cpu:.3g} by "
            f"CPU time; best on this machine {peak:.3g} FLOP/s, cached in {cache_dir()})")
  return peak * count, source
