"""Where `rljax plan` compiles for: a deviceless TPU topology, or N simulated CPU devices.

Names follow Google Cloud's accelerator types, which count TensorCores for v4 and v5p (two per
chip, driven as one "megacore" device) and chips for v5e and v6e:

    v5p-8  -> v5p:2x2x1,  4 chips      v5p-16 -> v5p:2x2x2,  8 chips     v5p-32 -> v5p:2x2x4, 16 chips
    v4-8   -> v4:2x2x1,   4 chips      v5e-8  -> v5e:2x4,    8 chips     v6e-8  -> v6e:2x4,    8 chips

A raw topology (`v5p:2x2x2`) is accepted as is, `cpu:N` compiles for N simulated CPU devices,
and `gpu:N` for the first N GPUs of this machine (XLA's GPU compiler; nothing runs on them). TPU
topologies need `libtpu` (`pip install rljax[tpu]`); nothing runs on a chip, the TPU compiler only
builds the program (`jax.experimental.topologies`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from rljax.errors import ConfigError

GIB = 2**30

# HBM per chip that the TPU compiler plans against, in GiB: the "available HBM" figure of
# libtpu 0.0.42.1's out-of-memory message for each generation (a little under the marketed size).
HBM_GIB = {"v4": 30.75, "v5e": 15.75, "v5p": 95.74, "v6e": 31.25}
# Generations whose accelerator-type number counts TensorCores (two per chip).
_COUNTS_CORES = {"v4", "v5p"}
# Chips -> slice shape, for the accelerator-type names.
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}

ACCEPTED = ("v5p-8, v5p-16, v5p-32, ... (TensorCores), v4-8, ... (TensorCores), v5e-8, v6e-8, ... (chips), "
            "a raw topology such as v5p:2x2x2, cpu:N (N simulated CPU devices), or gpu:N (this machine's GPUs)")


@dataclasses.dataclass(frozen=True)
class Topology:
  """A compile target.

  name: as the user gave it; platform: "tpu", "cpu" or "gpu"; generation: "v5p", ..., "cpu", or the
  GPU's device kind; shape: the libtpu topology ("2x2x1"), "" for cpu and gpu; chips: devices in the
  mesh (one per chip: v4 and v5p run as megacore); hbm_bytes: memory per chip the plan is checked
  against (None for cpu unless given with --hbm-gib; for gpu what XLA's allocator may use on it).
  """
  name: str
  platform: str
  generation: str
  shape: str
  chips: int
  hbm_bytes: int | None

  @property
  def libtpu_name(self) -> str:
    return f"{self.generation}:{self.shape}"

  def describe(self) -> str:
    if self.platform == "cpu":
      return f"{self.chips} simulated CPU devices"
    if self.platform == "gpu":
      mem = f", {self.hbm_bytes / GIB:.2f} GiB for XLA each" if self.hbm_bytes else ""
      return f"{self.chips} x {self.generation} (this machine's GPUs){mem}"
    hbm = f", {self.hbm_bytes / GIB:.2f} GiB HBM each" if self.hbm_bytes else ""
    return f"{self.libtpu_name}, {self.chips} chips{hbm}"

  def with_hbm(self, hbm_gib: float | None) -> "Topology":
    if hbm_gib is None:
      return self
    if not hbm_gib > 0:
      raise ConfigError(f"--hbm-gib={hbm_gib} must be > 0 (the memory per chip to check the plan against).")
    return dataclasses.replace(self, hbm_bytes=int(hbm_gib * GIB))

  def devices(self) -> list:
    """The devices to build the mesh from: compile-only TPU devices, or the first N CPU or GPU devices."""
    if self.platform == "cpu":
      return cpu_devices(self.chips)
    if self.platform == "gpu":
      return gpu_devices(self.name, self.chips)
    return tpu_devices(self)


def parse_topology(name: str) -> Topology:
  """`v5p-8`, `v5p:2x2x2`, `v5e-8`, `cpu:8`, ... -> Topology; ConfigError naming --topology otherwise."""
  text = (name or "").strip().lower()
  m = re.fullmatch(r"cpu:(\d+)", text)
  if m:
    n = int(m.group(1))
    if n < 1:
      raise ConfigError(f"--topology={name!r}: cpu:N needs N >= 1 simulated devices.")
    return Topology(name, "cpu", "cpu", "", n, None)
  m = re.fullmatch(r"gpu:(\d+)", text)
  if m:
    return gpu_topology(name, int(m.group(1)))
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", text)
  if m:
    gen, count = _ALIASES.get(m.group(1), m.group(1)), int(m.group(2))
    if gen not in HBM_GIB:
      raise _bad(name, f"unknown TPU generation {m.group(1)!r}")
    chips = count // 2 if gen in _COUNTS_CORES else count
    shapes = _SHAPES_3D if gen in ("v4", "v5p") else _SHAPES_2D
    if gen in _COUNTS_CORES and count % 2 or chips not in shapes:
      unit = "TensorCores (2 per chip)" if gen in _COUNTS_CORES else "chips"
      sizes = ", ".join(f"{gen}-{c * 2 if gen in _COUNTS_CORES else c}" for c in list(shapes)[:6])
      raise _bad(name, f"{gen}-N counts {unit}; known sizes are {sizes}, ... (or give a raw topology "
                       f"such as {gen}:{list(shapes.values())[1]})")
    return Topology(name, "tpu", gen, shapes[chips], chips, int(HBM_GIB[gen] * GIB))
  m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", text)
  if m:
    gen = _ALIASES.get(m.group(1), m.group(1))
    if gen not in HBM_GIB:
      raise _bad(name, f"unknown TPU generation {m.group(1)!r}")
    chips = math.prod(int(d) for d in m.group(2).split("x"))
    return Topology(name, "tpu", gen, m.group(2), chips, int(HBM_GIB[gen] * GIB))
  raise _bad(name, "not a topology name")


def _bad(name: str, why: str) -> ConfigError:
  return ConfigError(f"--topology={name!r}: {why}. Use one of: {ACCEPTED}.")


def _quiet_libtpu_env() -> None:
  """Defaults that keep libtpu from probing for a TPU VM (and printing warnings) when it only compiles.

  ALLOW_MULTIPLE_LIBTPU_LOAD lets several planning processes (or a planning process beside a
  training one) load libtpu at once; nothing here opens a chip.
  """
  if any(k in os.environ for k in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")):
    return
  for key, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                     ("TPU_ACCELERATOR_TYPE", "v5p-8"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                     ("TPU_WORKER_ID", "0")):
    os.environ.setdefault(key, value)


def libtpu_available() -> bool:
  """Whether libtpu can be imported (the deviceless TPU compiler)."""
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None


def tpu_devices(topo: Topology) -> list:
  """Compile-only devices of `topo` (one per chip; v4 as megacore)."""
  if not libtpu_available():
    raise ConfigError(f"--topology={topo.name!r} compiles with the TPU compiler, which needs libtpu: "
                      "pip install 'rljax[tpu]' (libtpu==0.0.42.1 for jax 0.10.2), or plan on simulated CPU "
                      "devices with --topology cpu:N.")
  _quiet_libtpu_env()
  from jax.experimental import topologies
  kwargs = {"chip_config_name": "megacore"} if topo.generation == "v4" else {}
  try:
    desc = topologies.get_topology_desc(topology_name=topo.libtpu_name, platform="tpu", **kwargs)
  except Exception as e:  # noqa: BLE001 - libtpu raises JaxRuntimeError with the reason
    raise ConfigError(f"--topology={topo.name!r}: libtpu rejected {topo.libtpu_name!r} "
                      f"({str(e).splitlines()[0][:200]}). Use one of: {ACCEPTED}.") from None
  devices = list(desc.devices)
  if len(devices) != topo.chips:
    raise ConfigError(f"--topology={topo.name!r}: libtpu made {len(devices)} devices of {topo.libtpu_name!r}, "
                      f"expected {topo.chips}; give the raw topology instead.")
  return devices


def cpu_devices(n: int) -> list:
  """The first n CPU devices, asking jax for n of them if its backend has not started yet.

  The CPU device count is fixed when jax initialises its backends (XLA_FLAGS=
  --xla_force_host_platform_device_count=N or the jax_num_cpu_devices option, before any
  computation); a process that already started with fewer devices cannot grow them.
  """
  import jax
  if not backends_started():
    jax.config.update("jax_platforms", "cpu")
    if jax.config.jax_num_cpu_devices < n and f"device_count={n}" not in os.environ.get("XLA_FLAGS", ""):
      jax.config.update("jax_num_cpu_devices", n)
  devices = jax.devices("cpu")
  if len(devices) < n:
    raise ConfigError(f"--topology=cpu:{n} needs {n} CPU devices but this process has {len(devices)} (jax started "
                      f"before the plan); run `rljax plan` in a fresh process, or set "
                      f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts.")
  return devices[:n]


def gpu_devices(name: str, n: int) -> list:
  """The first n GPUs jax sees; a ConfigError naming --topology when it sees fewer."""
  import jax
  try:
    devices = jax.devices("gpu")
  except RuntimeError as e:
    raise ConfigError(f"--topology={name!r} compiles for this machine's GPUs, but jax finds none ({str(e)[:200]}); "
                      "`rljax plan` keeps jax on the CPU unless JAX_PLATFORMS is set: run it with "
                      "JAX_PLATFORMS=cuda.") from None
  if len(devices) < n:
    raise ConfigError(f"--topology={name!r} needs {n} GPUs; jax sees {len(devices)} here.")
  return devices[:n]


def gpu_topology(name: str, n: int) -> Topology:
  """`gpu:N`: the first N GPUs of this machine, compiled for by XLA's GPU compiler (nothing runs on
  them), checked against the memory XLA's allocator may use on one (its `bytes_limit`:
  XLA_PYTHON_CLIENT_MEM_FRACTION of the card, 0.75 unless set). Starts jax's GPU backend."""
  if n < 1:
    raise ConfigError(f"--topology={name!r}: gpu:N needs N >= 1 GPUs.")
  device = gpu_devices(name, n)[0]
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 - a runtime without memory stats: no limit to check against
    limit = None
  return Topology(name, "gpu", device.device_kind, "", n, int(limit) if limit else None)


def backends_started() -> bool:
  """Whether jax has started its backends (after which the platforms and CPU device count are fixed).

  jax has no public query for this; its xla_bridge has one. Where that is missing, assume started
  (the safe answer: nothing is reconfigured).
  """
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return True


def next_larger(topo: Topology) -> str | None:
  """The accelerator-type name of the next larger slice of the same generation (for suggestions)."""
  if topo.platform == "cpu":
    return f"cpu:{topo.chips * 2}"
  if topo.platform == "gpu":   # this machine's GPUs: no larger slice to suggest
    return None
  shapes = _SHAPES_3D if topo.generation in ("v4", "v5p") else _SHAPES_2D
  bigger = [c for c in shapes if c > topo.chips]
  if not bigger:
    return None
  chips = bigger[0]
  return f"{topo.generation}-{chips * 2 if topo.generation in _COUNTS_CORES else chips}"
