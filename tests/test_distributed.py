"""Multi-process training: 2 jax.distributed processes on localhost match 1 process.

Each process is a real `rljax train` subprocess with one CPU device; the processes find each
other through JAX_COORDINATOR_ADDRESS and reduce gradients with CPU (gloo) collectives. The
reference is one process with two devices. Each process scores the rows its own device holds
(rewards/callback.py), so both processes score, and the logged reward metrics are combined over
processes.
"""
import json
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

CONFIG = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py")
STEPS = 2
LR, EPS = 0.1, 1e-3      # Adam with eps = 1e-3: parameters are a Lipschitz function of the gradients (test_mesh.py)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train(out_dir, devices: int, env_extra: dict, distributed: bool, *overrides):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **env_extra)
  args = [sys.executable, "-m", "rljax.cli", "train", "--config", CONFIG, f"--config.train.steps={STEPS}",
          f"--config.output.dir={out_dir}", "--config.eval.before_and_after=False", "--config.output.export_hf=False",
          "--config.output.progress=False", "--config.output.tensorboard=False", "--config.checkpoint.async_save=False",
          f"--config.mesh.distributed={distributed}", f"--config.optim.learning_rate={LR}",
          f"--config.optim.eps={EPS}", *[f"--config.{o}" for o in overrides]]
  return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc, timeout=600):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-4000:]
  return out


def _two_processes(out_dir, *overrides):
  port = _free_port()
  workers = [
      _train(out_dir, 1, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                          "JAX_PROCESS_ID": str(i)}, True, *overrides)
      for i in range(2)
  ]
  try:
    for w in workers:
      _wait(w)
  finally:
    for w in workers:
      w.kill()
  return _results(out_dir)


def _results(out_dir):
  """(metrics of each step, final parameters as {path: array}) of a finished run."""
  with open(os.path.join(out_dir, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f if "loss" in line]
  import jax

  from rljax.trainer.checkpoint import Checkpointer
  params = Checkpointer(os.path.join(out_dir, "checkpoints"), read_only=True).restore_params()
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
  return metrics, {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  out = tmp_path_factory.mktemp("single")
  _wait(_train(out, 2, {}, False))
  return _results(out)


def _assert_match(multi, single):
  """Same rollouts and rewards; losses, gradient norms and parameters to float32 reduction order.

  The gradient all-reduce runs over gloo in one case and in-process in the other: gradients
  agree to rho = 2e-5 of their norm (test_mesh.py derives it), so losses and gradient norms to
  relative rho, and the parameters after 2 Adam steps (eps = 1e-3) to 3 * (lr/eps) * rho * |g| in L2.
  """
  (m_multi, p_multi), (m_single, p_single) = multi, single
  assert len(m_multi) == len(m_single) == STEPS
  rho = 2e-5
  for m, s in zip(m_multi, m_single):
    assert m["reward/mean"] == s["reward/mean"]
    assert m["reward/std"] == s["reward/std"]
    assert m["sampler/tokens"] == s["sampler/tokens"]
    np.testing.assert_allclose(m["loss"], s["loss"], rtol=rho, atol=1e-6)
    np.testing.assert_allclose(m["grad_norm"], s["grad_norm"], rtol=rho)
    # Both processes scored their own rows, and the logged figures cover all of them.
    assert m["verifier/scoring_processes"] == 2.0 and s["verifier/scoring_processes"] == 1.0
    assert m["verifier/items"] == s["verifier/items"]
  bound = 3 * (LR / EPS) * rho * max(s["grad_norm"] for s in m_single)
  assert p_multi.keys() == p_single.keys()
  diff = math.sqrt(sum(float(np.sum((p_multi[k] - p_single[k]).astype(np.float64) ** 2)) for k in p_multi))
  assert diff <= bound, (diff, bound)


def test_two_processes_match_one_process(tmp_path, one_process):
  """The batch split over 2 processes (mesh data axis across them)."""
  _assert_match(_two_processes(tmp_path / "multi"), one_process)
  # Only process 0 writes the metrics file and the config.
  assert os.path.exists(tmp_path / "multi" / "config.json")


def test_fsdp_across_two_processes_matches_one_process(tmp_path, one_process):
  """Parameters sharded over 2 processes (mesh (1, 2, 1): fsdp across them; it crashed with a
  gloo 'collective mismatch' while process 0 alone scored the batch)."""
  _assert_match(_two_processes(tmp_path / "fsdp", "mesh.shape=(1,-1,1)"), one_process)


def test_pipelined_rollouts_across_two_processes_match_one_process(tmp_path, one_process):
  """rollout.mode='pipelined' (max_staleness=0: the exact schedule) with the batch split over 2
  processes: each process brings its own rows to the host, scores them and hands the rewards back
  as its block of the global array; the run equals the one-process fused run."""
  _assert_match(_two_processes(tmp_path / "pipelined", "rollout.mode='pipelined'", "rollout.max_staleness=0"),
                one_process)


def test_partial_rollouts_carry_groups_across_two_processes(tmp_path):
  """rollout.mode='partial' (a pool of 2 x the batch, a group may be trained one version late) on 2
  processes: each process keeps the pool of its own prompts on the rows its device holds, both
  decode the segments together until each has its share of the groups complete, and each scores
  its own rows. Every step trains a full batch that both processes scored, within the staleness
  bound; unfinished groups are carried (completions end at geometric lengths: ~5% of the
  vocabulary stops) and their carried tokens and log-probs stay with their rows: the learner's
  lp_old, recomputed with parameters that barely moved, equals them. (Not compared with one
  process: there one pool picks the batch's groups, here each process picks its share.)"""
  stops = "[" + ",".join(map(str, range(100, 2600))) + "]"
  metrics, _ = _two_processes(tmp_path / "carry", "rollout.mode='partial'", "rollout.max_staleness=1",
                              "sampling.max_new_tokens=32", "train.prompts_per_step=4", "sampling.num_samples=4",
                              f"sampling.stop_token_ids={stops}", "optim.learning_rate=1e-9", "train.steps=4")
  assert [m["step"] for m in metrics] == [1, 2, 3, 4]
  for m in metrics:
    assert m["verifier/scoring_processes"] == 2.0 and m["verifier/items"] == 16   # 4 prompts x 4 samples
    assert m["rollout/staleness"] <= 1 and math.isfinite(m["loss"])
  carried = [m for m in metrics if m["rollout/rounds_mean"] > 1]
  assert carried and sum(m["rollout/groups_carried"] for m in metrics) > 0
  for m in carried:
    assert m["sampler_logprob_diff_max"] < 1e-4, m["sampler_logprob_diff_max"]


def test_a_stop_signal_on_one_process_stops_both_after_the_same_step(tmp_path):
  """A preemption notice (SIGTERM) that reaches only process 1 stops both processes after the same
  step (they agree through an all-gather of the flag after every step), with one checkpoint of
  that step, and each exits cleanly; without the agreement process 0 would wait in the next
  step's collectives forever."""
  import re
  import signal
  import time
  out = tmp_path / "stopped"
  port = _free_port()
  env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
  workers = [_train(out, 1, {**env, "JAX_PROCESS_ID": str(i)}, True, "train.steps=200", "checkpoint.every=0")
             for i in range(2)]
  try:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and '"loss"' in metrics.read_text()):   # a step is done: stop mid-run
      assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "no step finished"
      time.sleep(0.5)
    workers[1].send_signal(signal.SIGTERM)
    outputs = [w.communicate(timeout=600)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  assert [w.returncode for w in workers] == [0, 0], [o[-3000:] for o in outputs]
  stopped = [re.search(r"stopped by (SIGTERM|a stop signal to another process of the run) after step (\d+) of 200", o)
             for o in outputs]
  assert all(stopped), [o[-3000:] for o in outputs]
  step = int(stopped[0].group(2))
  assert int(stopped[1].group(2)) == step < 200
  assert stopped[0].group(1) != "SIGTERM" and stopped[1].group(1) == "SIGTERM"
  assert "SIGTERM received" in outputs[1] and "SIGTERM received" not in outputs[0]
  from rljax.trainer.checkpoint import Checkpointer
  assert Checkpointer(os.path.join(out, "checkpoints"), read_only=True).latest_step() == step


def test_sigterm_to_both_processes_then_a_restart_reproduces_an_uninterrupted_run(tmp_path):
  """A pod preempted mid-run: SIGTERM to both processes stops them after the same step with one
  checkpoint; the same command on both resumes there, and the 6 steps' metrics and final
  parameters equal those of a 2-process run that was never interrupted."""
  import re
  import signal
  import time
  steps = ("train.steps=6", "checkpoint.every=0")
  whole = _two_processes(tmp_path / "whole", *steps)

  out = tmp_path / "preempted"
  env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": "2"}
  workers = [_train(out, 1, {**env, "JAX_PROCESS_ID": str(i)}, True, *steps) for i in range(2)]
  try:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
      assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "no step finished"
      time.sleep(0.2)
    for w in workers:
      w.send_signal(signal.SIGTERM)
    outputs = [w.communicate(timeout=600)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  assert [w.returncode for w in workers] == [0, 0], [o[-3000:] for o in outputs]
  stopped = [re.search(r"stopped by SIGTERM after step (\d+) of 6", o) for o in outputs]
  assert all(stopped), [o[-3000:] for o in outputs]
  step = int(stopped[0].group(1))
  assert int(stopped[1].group(1)) == step < 6

  resumed = _two_processes(out, *steps)   # the same command again, on both processes
  (m_resumed, p_resumed), (m_whole, p_whole) = resumed, whole
  assert [m["step"] for m in m_resumed] == [m["step"] for m in m_whole] == list(range(1, 7))
  for r, w in zip(m_resumed, m_whole):
    for key in ("reward/mean", "reward/std", "sampler/tokens", "loss", "grad_norm"):
      assert r[key] == w[key], (r["step"], key, r[key], w[key])
  assert p_resumed.keys() == p_whole.keys()
  for k in p_whole:
    np.testing.assert_array_equal(p_resumed[k], p_whole[k], err_msg=k)
