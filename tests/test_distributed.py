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
  decode the segments together until the batch's groups are complete over both, and each scores
  the rows it trains. Every step trains a full batch that both processes scored, within the
  staleness bound; unfinished groups are carried (completions end at geometric lengths: ~5% of the
  vocabulary stops) and their carried tokens and log-probs stay with their rows: the learner's
  lp_old, recomputed with parameters that barely moved, equals them. (Not compared with one
  process: with carried groups each process refills its own pool, so the joint pool's order is
  not one process's after the first step; at max_staleness=0 it is, tested below.)"""
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


_TOOL_ENGINE = """
import json, os, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[2])
from tools_testlib import scripted_tool_rollout
from rljax import sharding as shd
shd.maybe_initialize_distributed()      # with JAX_COORDINATOR_ADDRESS set: one of 2 processes
from rljax.config import base_config
from rljax.rollout import SamplingParams
from rljax.tools import ToolRunner
from rljax.trainer.setup import load_policy
c = base_config()
c.model.path, c.model.random.num_layers = "random", 2
mesh = shd.make_mesh((-1, 1, 1))
with shd.activate(mesh):
  policy = load_policy(c.model, "smollm2-135m-instruct", mesh=mesh)
tok = policy.tokenizer
ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False))
       for t in ("What is 6*7?", "Add 2 and 3, then square ten.")]
width = max(len(i) for i in ids)
pids, pmask = np.zeros((2, width), np.int32), np.zeros((2, width), bool)
for r, i in enumerate(ids):
  pids[r, width - len(i):], pmask[r, width - len(i):] = i, True
body = '{{"name": "calculator", "arguments": {{"expression": "{}"}}}}'
call = lambda e: tok.encode("Let me check. <tool_call>" + body.format(e) + "</tool_call>")
# Row 0 (prompt 0) calls once; row 3 (prompt 1) twice: rounds where only one process's rows call.
script = {(0, 0): call("6*7"), (3, 0): call("2+3"), (3, 1): call("10*10")}
sp = SamplingParams(num_samples=2, max_new_tokens=96, temperature=1.0, stop_token_ids=tuple(tok.stop_ids))
sharding = shd.batch_sharding(mesh, 2, 2)
mine = shd.local_indices(sharding, pids.shape)
put = lambda x: shd.rows_from_processes(x[mine], sharding, 2)
with ToolRunner(["calculator"], timeout_s=30.0, num_workers=1) as runner, shd.activate(mesh):
  engine = scripted_tool_rollout(policy.config, tok, runner, sp, script, segment_tokens=8)
  _, info = engine.run(policy.params, put(pids), put(pmask), jax.random.key(3))
t = info.trajectories
with open(sys.argv[1] + f"/rows{jax.process_index()}.json", "w") as f:
  json.dump({"tokens": t.tokens.tolist(), "logprobs": t.logprobs.tolist(), "lengths": t.lengths.tolist(),
             "turns": t.turns.tolist(), "context": t.context_mask.tolist(), "metrics": info.metrics}, f)
"""


def _tool_engine(out, processes: int):
  """Runs _TOOL_ENGINE over 2 devices: one process with 2, or 2 jax.distributed processes with 1."""
  out.mkdir()
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={2 // processes}")
  procs = []
  for i in range(processes):
    extra = {} if processes == 1 else {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                       "JAX_PROCESS_ID": str(i)}
    procs.append(subprocess.Popen([sys.executable, "-c", _TOOL_ENGINE, str(out), os.path.dirname(__file__)],
                                  env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  try:
    for p in procs:
      _wait(p)
  finally:
    for p in procs:
      p.kill()
  parts = [json.load(open(out / f"rows{i}.json")) for i in range(processes)]
  rows = {k: sum((p[k] for p in parts), []) for k in ("tokens", "logprobs", "lengths", "turns", "context")}
  return rows, parts[0]["metrics"]


def test_multi_turn_tool_rollouts_across_two_processes_match_one_process(tmp_path):
  """The multi-turn tool engine with its 4 rows split over 2 processes: each process runs the tool
  calls of its own rows (row 0's on process 0, row 3's on process 1, which calls twice, so some
  feed rounds have calls on one process only and both must still feed together). The
  trajectories (tokens, tool responses, masks, turns, lengths) equal one process's with 2 devices,
  log-probs to 1e-6, and the metrics count both processes' calls."""
  one, m_one = _tool_engine(tmp_path / "one", 1)
  two, m_two = _tool_engine(tmp_path / "two", 2)
  assert one["turns"] == two["turns"] == [1, 0, 0, 2]
  for key in ("tokens", "lengths", "context"):
    assert one[key] == two[key], key
  np.testing.assert_allclose(np.asarray(two["logprobs"]), np.asarray(one["logprobs"]), atol=1e-6)
  assert m_one["tools/calls"] == m_two["tools/calls"] == 3.0
  assert m_one["tools/feeds"] == m_two["tools/feeds"] and m_one["tools/turns_mean"] == m_two["tools/turns_mean"] == 0.75


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


@pytest.mark.parametrize("mode", [(), ("rollout.mode='async'", "rollout.max_staleness=0")], ids=["fused", "async"])
def test_sigterm_to_both_processes_then_a_restart_reproduces_an_uninterrupted_run(tmp_path, mode):
  """A pod preempted mid-run: SIGTERM to both processes stops them after the same step with one
  checkpoint; the same command on both resumes there, and the 6 steps' metrics and final
  parameters equal those of a 2-process run that was never interrupted. Also async across the
  processes (generator on one, learner on the other; on-policy, so its batches are reproducible)."""
  import re
  import signal
  import time
  steps = ("train.steps=6", "checkpoint.every=0", *mode)
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


def test_async_across_two_processes_generator_on_one_learner_on_the_other(tmp_path):
  """rollout.mode='async' with the generator on one process's device and the learner on the
  other's: batches cross from the generator to the learner, and parameters back, through the
  bridge (rljax/trainer/bridge.py). At max_staleness=0 it equals the same mode in one process with
  two devices (one generator, one learner: the same programs on the same device counts, so equal
  to the float32 bit here; parameters to 1e-6 to leave room for the collective's copy). At
  max_staleness=1 (under LoRA) it trains within the bound, publishing every update, exports, and
  a restart resumes from the checkpoint process 0 (a learner) saved."""
  exact = ("rollout.mode='async'", "rollout.max_staleness=0")
  single = tmp_path / "single"
  _wait(_train(single, 2, {}, False, *exact))
  (m_multi, p_multi), (m_single, p_single) = _two_processes(tmp_path / "exact", *exact), _results(single)
  assert [m["step"] for m in m_multi] == [m["step"] for m in m_single] == [1, 2]
  for m, s in zip(m_multi, m_single):
    for key in ("reward/mean", "reward/std", "sampler/tokens", "verifier/items", "rollout/staleness"):
      assert m[key] == s[key], (m["step"], key, m[key], s[key])
    np.testing.assert_allclose(m["loss"], s["loss"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m["grad_norm"], s["grad_norm"], rtol=1e-6)
    assert m["verifier/scoring_processes"] == 1.0    # the generator process scored every row
    assert m["rollout/publish_bytes"] == s["rollout/publish_bytes"] > 0
  assert p_multi.keys() == p_single.keys()
  for k in p_multi:
    np.testing.assert_allclose(p_multi[k], p_single[k], atol=1e-6, err_msg=k)

  # Under LoRA (the base crosses once, then the adapters), with the export written by process 0.
  stale = tmp_path / "stale"
  run = ("rollout.mode='async'", "rollout.max_staleness=1", "model.lora.rank=4", "model.lora.alpha=8.0",
         "output.export_hf=True")
  first, _ = _two_processes(stale, *run, "train.steps=4")
  assert [m["step"] for m in first] == [1, 2, 3, 4]
  adapters = first[1]["rollout/publish_bytes"]
  assert first[0]["rollout/publish_bytes"] > 100 * adapters > 0   # step 1: the base, then the adapters twice
  assert [m["rollout/publish_bytes"] for m in first[1:]] == [adapters] * 3
  assert os.path.isfile(stale / "hf" / "model.safetensors") and os.path.isfile(stale / "peft" / "adapter_config.json")
  resumed, _ = _two_processes(stale, *run, "train.steps=6")
  assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]   # steps 5 and 6 appended by the restart
  assert resumed[:4] == first
  for m in resumed:
    assert m["rollout/staleness"] in (0.0, 1.0) and m["rollout/staleness_0"] + m["rollout/staleness_1"] == 1.0
    assert m["rollout/publish_bytes"] > 0 and math.isfinite(m["loss"])
    assert m["verifier/items"] == first[0]["verifier/items"] > 0
  assert first[0]["rollout/staleness"] == 0.0 and resumed[4]["rollout/staleness"] == 0.0   # a fresh start is on-policy


def test_async_across_processes_refuses_a_process_on_both_sides(tmp_path):
  """2 processes of 2 devices, rollout.generator_devices=1: the generator would take one of process
  1's devices and the learner the other. Both processes stop before any model is built, naming the
  field and the devices per process."""
  port = _free_port()
  workers = [_train(tmp_path / "mixed", 2, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                            "JAX_PROCESS_ID": str(i)}, True,
                    "rollout.mode='async'", "rollout.generator_devices=1") for i in range(2)]
  try:
    outputs = [w.communicate(timeout=300)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  for w, out in zip(workers, outputs):
    assert w.returncode != 0, out[-2000:]
    assert "process 1's devices fall on both sides" in out and "rollout.generator_devices" in out, out[-2000:]
    assert "multiple of the devices per process (2)" in out, out[-2000:]
    assert not (tmp_path / "mixed" / "checkpoints").exists()


def test_partial_rollouts_at_staleness_0_across_two_processes_match_one_process(tmp_path):
  """rollout.mode='partial' at max_staleness=0 (no group outlives its call) with the batch split
  over 2 processes equals the same mode in one process with two devices: the joint pool, the
  stopping rule and the choice of groups are the one-process ones, and picked groups move to the
  process that trains them (rljax/rollout/partial.py). Checked that a move happened: a step whose
  first P/2 complete groups were not all process 0's."""
  exact = ("rollout.mode='partial'", "rollout.max_staleness=0")
  _wait(_train(tmp_path / "single", 2, {}, False, *exact))
  multi = _two_processes(tmp_path / "multi", *exact)
  _assert_match(multi, _results(tmp_path / "single"))
  moved = [m["rollout/groups_moved"] for m in multi[0]]
  assert sum(moved) > 0
