"""The end-of-step deadline of multi-process runs (rljax/trainer/stopping.py `reached_step`): two
real jax.distributed processes on localhost; one stops arriving, the other names it instead of
waiting forever. And the config field's validation."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rljax.config_overrides import load_config_file
from rljax.errors import ConfigError

CONFIG = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py")

SCRIPT = textwrap.dedent("""
    import sys, time
    import jax
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from rljax.trainer.stopping import ProcessDeadline, any_process_requested, reached_step
    me = jax.process_index()
    for step in (1, 2, 3):   # both arrive: no error, and the flags are agreed
      assert any_process_requested(step, me == 1 and step == 3, deadline_s=60.0) is (step == 3)
    if me == 1:
      time.sleep(8.0)        # never announces step 4 in time
      print("slow process done", flush=True)
    else:
      start = time.monotonic()
      try:
        reached_step(4, deadline_s=2.0)
      except ProcessDeadline as e:
        print(f"DEADLINE after {time.monotonic() - start:.1f} s: {e}", flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_a_process_that_does_not_finish_the_step_is_named(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(SCRIPT)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, str(script), address, str(i)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], outs
  line = next((x for x in outs[0].splitlines() if x.startswith("DEADLINE")), None)
  assert line is not None, outs[0][-3000:]
  assert "process(es) [1] of 2 did not finish step 4 within train.process_deadline_s=2 s (this is process 0)" in line
  assert "--config.train.process_deadline_s" in line
  waited = float(line.split("after ")[1].split(" s")[0])
  assert 1.9 <= waited < 8.0, line     # the deadline, not the slow process, ended the wait
  assert "slow process done" in outs[1]


@pytest.mark.parametrize("value", [-1.0, -0.001])
def test_process_deadline_must_be_seconds(value):
  from rljax.config import validate
  cfg = load_config_file(CONFIG)
  with cfg.unlocked():
    cfg.train.process_deadline_s = value
  with pytest.raises(ConfigError, match="config.train.process_deadline_s=.*must be a number of seconds >= 0"):
    validate(cfg)
