"""Device check part `env`: the machine, the versions, and the peak rljax's MFU figures divide by."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time

from checklib import Context, Recorder, device_summary

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "chex",
            "grain", "ml_collections", "numpy", "torch", "transformers", "trl", "datasets", "accelerate", "peft",
            "tokenizers", "safetensors", "math-verify", "gguf", "tensorboardX", "gin-config", "array-record")


def env(rec: Recorder, ctx: Context) -> None:
  import jax

  from rljax import flops
  summary = device_summary()
  summary["jax"] = jax.__version__
  rec.row("device", "ok" if ctx.cpu or summary["platform"] == "gpu" else "fail", summary,
          "" if ctx.cpu or summary["platform"] == "gpu" else "expected a GPU: jax did not find one")
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  rec.row("package versions", "ok", versions, f"Python {sys.version.split()[0]}")
  if not ctx.cpu:
    rec.guarded("nvidia-smi", lambda: _nvidia_smi(rec))

  def peak():
    value, source = flops.device_peak_flops("bfloat16")
    # A GPU or TPU must be in rljax's spec-sheet table; only CPUs (and unknown chips) are timed.
    known = ctx.cpu or source.startswith("spec sheet")
    rec.row("peak bf16 FLOP/s for MFU (rljax.flops)", "ok" if known else "fail", {"tflops": value / 1e12},
            source if known else f"{source}: add this device kind to rljax/flops.py _PEAK_BF16")
  rec.guarded("peak bf16 FLOP/s for MFU (rljax.flops)", peak)

  def matmul():
    import jax.numpy as jnp
    size = 8192 if jax.devices()[0].platform == "gpu" else 512
    rate = flops.matmul_peak(size, dtype=jnp.bfloat16, iters=10, reduce=min)
    spec, _ = flops.device_peak_flops("bfloat16")
    rec.row(f"measured bf16 matmul {size}^3", "ok", {"tflops": rate / 1e12, "of_peak": rate / spec},
            "best of 10 after a warm-up; of_peak: against the figure above")
  rec.guarded("measured bf16 matmul", matmul)


def _nvidia_smi(rec: Recorder) -> None:
  out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
  rec.row("nvidia-smi", "ok" if out.returncode == 0 else "fail", {"gpu": out.stdout.strip() or out.stderr.strip()})


def selftest_crash(rec: Recorder, ctx: Context) -> None:
  """For tests/test_device_check.py: one row, then a crash (the check must record both)."""
  rec.row("before the crash", "ok", {"x": 1.0})
  raise RuntimeError("selftest: this part crashes on purpose")


def selftest_hang(rec: Recorder, ctx: Context) -> None:
  """For tests/test_device_check.py: one row, then a hang past the part's timeout."""
  rec.row("before the hang", "ok", {"x": 1.0})
  time.sleep(3600)
