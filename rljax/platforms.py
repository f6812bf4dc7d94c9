"""Choosing JAX's platform before it starts, so a CPU machine with libtpu installed stays quiet.

JAX tries every backend it has a plugin for. With libtpu installed (`pip install 'rljax[tpu]'`,
which `rljax plan` needs for its TPU compiles, and the dev extra) and no TPU attached, libtpu's
start-up prints "could not determine TPU accelerator type" and "unexpected worker hostname"
blocks before JAX falls back to the CPU. `quiet_without_tpu()` checks the PCI bus for TPU chips
the way JAX does (`jax._src.hardware_utils`) and, when there are none and no GPU is visible
either, sets `JAX_PLATFORMS=cpu`, so the TPU plugin is never initialised. An explicit
JAX_PLATFORMS is always left as it is.
"""
from __future__ import annotations

import glob
import os
import sys

_GOOGLE_PCI_VENDOR = "0x1ae0"
_GPU_DEVICE_GLOBS = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dri/renderD*")


def tpu_chips() -> int:
  """TPU chips on this host's PCI bus (Google's vendor id; what JAX counts before it loads libtpu)."""
  try:
    from jax._src import hardware_utils
    return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
  except Exception:   # noqa: BLE001 - a private JAX helper: fall back to reading the bus directly
    count = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
      try:
        with open(vendor, encoding="ascii") as f:
          count += f.read().strip() == _GOOGLE_PCI_VENDOR
      except OSError:
        pass
    return count


def gpu_visible() -> bool:
  return any(glob.glob(pattern) for pattern in _GPU_DEVICE_GLOBS)


def quiet_without_tpu() -> str | None:
  """Sets JAX_PLATFORMS=cpu when neither a TPU nor a GPU is attached and JAX_PLATFORMS is unset.
  Returns the platform chosen, or None (left to JAX). Call it before JAX initialises a backend."""
  if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME"):
    return None
  if tpu_chips() or gpu_visible():
    return None
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:   # imported already (its config read the environment then): tell it directly
    import jax
    jax.config.update("jax_platforms", "cpu")
  return "cpu"
