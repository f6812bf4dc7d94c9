"""Test setup: 8 simulated CPU devices so every sharded path is exercised on this machine."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module. XLA's CPU JIT maps memory for every
  executable, and one pytest process of the whole suite kept thousands alive: past the kernel's
  vm.max_map_count (65530 here) a compile crashes the process (a segfault in
  backend_compile_and_load, seen once the LoRA tests joined the suite)."""
  yield
  import jax
  jax.clear_caches()
  gc.collect()
