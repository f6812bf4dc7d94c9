"""No silent phases (issue 39 item 7): the heartbeat names the phase, and the program being compiled."""
import io
import logging
import time

import jax
import jax.numpy as jnp

from rljax import progress


def test_heartbeat_names_the_phase_and_the_program_compiling():
  stream = io.StringIO()

  def big(x):   # unrolled: XLA takes a moment to compile it
    for i in range(100):
      x = jnp.sin(x) * (1.0 + i * 1e-3) + jnp.cos(x[::-1])
    return x

  before = jax.config.jax_log_compiles
  with progress.Heartbeat(quiet_s=0.0, every_s=0.0, compile_s=0.0, tick_s=0.05, stream=stream):
    with progress.phase("testing the heartbeat"):
      jax.jit(big)(jnp.ones(64)).block_until_ready()
    with progress.phase("idle"):
      time.sleep(1.2)
  out = stream.getvalue()
  assert "rljax: compiling jit(big) (inside: testing the heartbeat):" in out, out
  assert "rljax: idle: 1 s so far" in out, out
  assert jax.config.jax_log_compiles == before           # restored
  assert progress._ACTIVE is None


def test_compile_log_lines_are_consumed_not_printed(caplog):
  with caplog.at_level(logging.WARNING):
    with progress.Heartbeat(quiet_s=60, stream=io.StringIO()):
      with progress.phase("x"):
        jax.jit(lambda x: x * 3 + 1)(jnp.ones(5)).block_until_ready()
    jax.jit(lambda x: x * 5 + 2)(jnp.ones(5)).block_until_ready()
  assert not [r for r in caplog.records if "Compiling" in r.getMessage() or "Finished" in r.getMessage()]
