"""A run's life through `rljax train` as a user meets it (issue 39): Ctrl-C and SIGTERM save and
resume, a second signal exits at once, a second run into a used directory stops at once, a run
killed after its last checkpoint completes on re-run, and a CPU machine with libtpu is quiet.

Real subprocesses and real signals, on the smoke recipe with a verifier that waits (so a step
takes seconds and a signal lands inside one, while the main thread is inside XLA).
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from rljax.trainer import rundir

ROOT = os.path.join(os.path.dirname(__file__), "..")
SMOKE = os.path.join(ROOT, "rljax", "configs", "smoke.py")
# 64 rows of 8 tokens at 40 ms each on one worker: ~2.6 s of scoring per step.
SLOW = ('--config.rewards.components=[{"name": "vowels", "verifier": "slow_verifier:slow_vowel_fraction", '
        '"weight": 1.0, "kwargs": {"delay_s": 0.04}}]')
LIBTPU_NOISE = ("TPU accelerator type", "worker hostname", "libtpu")


def env():
  """The environment of a user's shell: no JAX_PLATFORMS (rljax must pick the CPU itself)."""
  e = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
  # scripts/ for the slow verifier (scripts/slow_verifier.py), as scripts/bench_rollouts.py does.
  e["PYTHONPATH"] = os.pathsep.join([os.path.abspath(ROOT), os.path.join(os.path.abspath(ROOT), "scripts"),
                                     e.get("PYTHONPATH", "")])
  return e


class Live:
  """`rljax ARGS` running in its own process group (as a terminal starts it), its output collected."""

  def __init__(self, *args):
    self.args = list(args)
    self.proc = subprocess.Popen([sys.executable, "-m", "rljax.cli", *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env(), start_new_session=True)
    self.out, self.err = [], []
    self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                     for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
    for t in self._threads:
      t.start()

  @staticmethod
  def _pump(stream, buf):
    for chunk in iter(lambda: stream.read1(4096), b""):
      buf.append(chunk.decode("utf-8", "replace"))

  @property
  def stdout(self):
    return "".join(self.out)

  @property
  def stderr(self):
    return "".join(self.err)

  def wait_for(self, pattern, timeout=240):
    """Waits until stderr or stdout matches `pattern`; returns the match."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      m = re.search(pattern, self.stderr) or re.search(pattern, self.stdout)
      if m:
        return m
      if self.proc.poll() is not None:
        time.sleep(0.5)
        m = re.search(pattern, self.stderr) or re.search(pattern, self.stdout)
        assert m, f"exited ({self.proc.returncode}) before {pattern!r}:\n{self.stdout}\n{self.stderr[-3000:]}"
        return m
      time.sleep(0.1)
    self.kill()
    raise AssertionError(f"no {pattern!r} in {timeout} s:\n{self.stdout}\n{self.stderr[-3000:]}")

  def signal(self, sig):
    os.killpg(self.proc.pid, sig)     # the whole process group, as a terminal's Ctrl-C does

  def finish(self, timeout=240):
    try:
      rc = self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise
    for t in self._threads:
      t.join(10)
    return rc

  def kill(self):
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """One persistent compilation cache for every run here: later starts load the smoke programs."""
  return str(tmp_path_factory.mktemp("compile-cache"))


def train_args(out, cache, *extra):
  return ["train", "--config", SMOKE, f"--config.output.dir={out}", "--config.output.tensorboard=False",
          "--config.checkpoint.async_save=False", f"--config.compile.cache_dir={cache}", SLOW, *extra]


def metric_steps(out):
  return [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]


def test_signals_stop_at_a_step_with_a_checkpoint_and_a_second_run_is_refused(tmp_path, compile_cache):
  """Items 3, 4, 5: Ctrl-C (SIGINT to the process group, during a step) saves a checkpoint at the
  step boundary, prints how to resume, and exits 130; a second `rljax train` into the directory
  meanwhile stops at once naming the first; the resume continues from the checkpoint; SIGTERM twice
  exits at once (143) and keeps the checkpoint; no libtpu noise on this CPU machine."""
  out = str(tmp_path / "run")
  first = Live(*train_args(out, compile_cache, "--config.train.steps=50"))
  try:
    first.wait_for(r"train: +\d+%.*\| 1/50")                    # a step is done: the loop is running
    second = Live(*train_args(out, compile_cache, "--config.train.steps=50"))
    assert second.finish(120) == 1
    assert f"is in use by another run: process {first.proc.pid}" in second.stderr, second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    first.signal(signal.SIGINT)
    first.wait_for(r"SIGINT received: the run stops after the step in progress", timeout=10)   # at once
    assert first.finish() == 130, first.stderr[-3000:]
  finally:
    first.kill()
  m = re.search(r"stopped by SIGINT after step (\d+) of 50; checkpoint of step \1", first.stdout)
  assert m, first.stdout + first.stderr[-3000:]
  step = int(m.group(1))
  assert "Traceback" not in first.stderr and "KeyboardInterrupt" not in first.stderr
  assert rundir.checkpoint_steps(out) == [step] and metric_steps(out) == list(range(1, step + 1))
  resume = re.search(r"resume with: (rljax train .*)", first.stdout).group(1)
  assert "--config.train.steps=50" in resume and not os.path.exists(os.path.join(out, rundir.SUMMARY_FILE))
  assert not any(noise in first.stderr + second.stderr for noise in LIBTPU_NOISE), first.stderr[-3000:]

  import shlex
  again = Live(*shlex.split(resume)[1:])                        # the printed command, as a user pastes it
  try:
    again.wait_for(rf"resuming {re.escape(out)} from step {step}")
    again.wait_for(rf"\| {step + 1}/50")                        # trained on from the checkpoint
    again.signal(signal.SIGTERM)
    again.wait_for(r"SIGTERM received", timeout=10)
    again.signal(signal.SIGTERM)
    assert again.finish(60) == 128 + signal.SIGTERM
  finally:
    again.kill()
  assert "SIGTERM again: exiting now" in again.stderr
  assert rundir.checkpoint_steps(out)[0] == step                # the earlier checkpoint is kept


def test_a_run_killed_after_its_last_checkpoint_completes_on_rerun(tmp_path, compile_cache):
  """Item 2: killed (SIGKILL) during its evaluation after training, a run has its last checkpoint
  but no evaluation, export or summary; the same command again does exactly those, then says it is
  finished."""
  out = str(tmp_path / "run")
  args = train_args(out, compile_cache, "--config.train.steps=2", "--config.checkpoint.every=2",
                    "--config.eval.before_and_after=True",
                    "--config.eval.num_examples=16", "--config.eval.samples=4", "--config.eval.temperature=1.0",
                    "--config.output.export_hf=True")
  run = Live(*args)
  try:
    run.wait_for(r"eval after training: scoring")
    run.proc.kill()                                               # SIGKILL: nothing runs after it
    run.finish()
  finally:
    run.kill()
  assert rundir.checkpoint_steps(out) == [2]
  assert not os.path.exists(os.path.join(out, "hf")) and not os.path.exists(os.path.join(out, rundir.SUMMARY_FILE))

  rerun = Live(*args)
  assert rerun.finish() == 0, rerun.stderr[-3000:]
  assert f"completing the run in {out}: it reached its last step (2)" in rerun.stdout
  accuracy = r"held-out accuracy before: [\d.]+% \+- [\d.]+ +after: [\d.]+% \+- [\d.]+"
  assert re.search(accuracy, rerun.stdout), rerun.stdout
  assert "Hugging Face export" in rerun.stdout and os.path.isfile(os.path.join(out, "hf", "config.json"))
  summary = json.load(open(os.path.join(out, rundir.SUMMARY_FILE)))
  assert summary["step"] == 2 and "eval_after" in summary and "eval_before" in summary
  rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]   # each evaluation logged once
  assert [r["step"] for r in rows if "loss" in r] == [1, 2]

  done = Live(*args)
  assert done.finish() == 0
  assert "is finished" in done.stdout and "nothing to train" in done.stdout
