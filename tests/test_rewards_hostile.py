"""Hostile verifiers through the public API (RewardSpec -> RewardPool -> score), each beside ten
normal items on 2 workers: what they try is contained, the normal items score right, the
counters are exact, nothing they started keeps running and the pool works afterwards.

The same cases run in-process (as root in CI) and, in one subprocess, as an unprivileged uid
(`test_hostile_verifiers_as_unprivileged_user`): `run_cases` is shared by both.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from rljax.rewards import RewardPool, RewardResult, RewardSpec

MARK = "RLJAX_HOSTILE_TEST"  # set in the environment the pool inherits: finds every process it made
NOBODY = 65534
TIMEOUT_S = 2.0
SPEC = {"components": [{"name": "v", "verifier": "test_rewards_hostile:hostile"}],
        "timeout_s": TIMEOUT_S, "batch_deadline_s": 30.0, "fallback": -1.0, "num_workers": 2,
        "max_memory_mb": 1024}
COUNTERS = ("timeouts", "errors", "crashes", "deadline_misses")

# ---- the verifier (module level: workers import it by reference) -----------------------------


def _daemonize(pidfile: str) -> None:
  """Double fork + setsid: a grandchild that writes its pid and sleeps, adopted away from us."""
  r, w = os.pipe()
  child = os.fork()
  if child == 0:
    os.setsid()
    if os.fork() == 0:
      with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
      os.write(w, b"x")
      time.sleep(1000)
      os._exit(0)
    os._exit(0)
  os.waitpid(child, 0)
  os.read(r, 1)


def hostile(completion, example):
  """Misbehaves as example['do'] says; otherwise sleeps example['sleep'] and scores 1.0."""
  do = example.get("do")
  if do == "stderr_flood":  # 100 MB, written straight to fd 2 (cheap, so it never nears the timeout)
    chunk = b"x" * (1 << 20)
    for _ in range(100):
      os.write(2, chunk)
  elif do == "kill_zygote":  # the worker's parent is the pool's zygote
    time.sleep(0.2)
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(5)
  elif do == "huge_score":
    return 1e300
  elif do == "huge_int_info":
    return RewardResult(1.0, {"n": 2**64})
  elif do == "daemon":
    _daemonize(example["pidfile"])
  elif do == "daemon_then_hang":
    _daemonize(example["pidfile"])
    time.sleep(1000)
  elif do == "fork_fallthrough":  # the child returns into the worker's loop
    if os.fork():
      time.sleep(0.1)
  elif do == "truncated_frame":  # half a frame onto the pool's socket, then hang
    for fd in map(int, os.listdir("/proc/self/fd")):
      try:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
          os.write(fd, struct.pack("!i", 1000) + b"x" * 10)
      except OSError:
        pass
    time.sleep(1000)
  else:
    time.sleep(example.get("sleep", 0.0))
  return 1.0


# ---- what is left running -----------------------------------------------------------------


def _marked_processes(token: str) -> set[int]:
  """Live processes whose environment carries MARK=token (our pool's processes and theirs)."""
  needle = f"{MARK}={token}".encode()
  found = set()
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read()
      with open(f"/proc/{entry}/stat", "rb") as f:
        state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
      continue
    if needle in env.split(b"\0") and state not in (b"Z", b"X"):
      found.add(int(entry))
  return found


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
  except OSError:
    return False


def _pool_pids(pool: RewardPool) -> set[int]:
  pids = {w.pid for w in pool._workers if w.alive}
  if pool._zygote is not None:
    pids.add(pool._zygote.proc.pid)
  return pids


def assert_nothing_left(pool: RewardPool | None, token: str, extra_pids=(), wait_s: float = 3.0) -> None:
  """No process of ours other than the pool's zygote and workers (none once it is closed)."""
  deadline = time.monotonic() + wait_s
  while True:
    allowed = _pool_pids(pool) if pool is not None and not pool._closed else set()
    strays = (_marked_processes(token) - allowed) | {p for p in extra_pids if _alive(p)}
    if not strays or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert not strays, f"left running: {sorted(strays)}"


# ---- the cases ------------------------------------------------------------------------------


def _beside_ten(pool: RewardPool, example: dict, sleep: float = 0.0):
  examples = [{"sleep": sleep}] * 5 + [example] + [{"sleep": sleep}] * 5
  start = time.monotonic()
  out = pool.score(["x"] * 11, examples)
  elapsed = time.monotonic() - start
  scores = out.components["v"].tolist()
  assert scores[:5] + scores[6:] == [1.0] * 10, scores
  return out, scores[5], elapsed


def _counts(out) -> dict[str, int]:
  return {k: int(out.metrics[f"verifier/{k}"]) for k in COUNTERS if out.metrics[f"verifier/{k}"]}


def case_stderr_flood(pool, workdir):
  # 100 MB to stderr: the score comes back (the caller checks that the bytes did not).
  out, score, elapsed = _beside_ten(pool, {"do": "stderr_flood"})
  assert score == 1.0 and _counts(out) == {} and elapsed < 5.0, (score, _counts(out), elapsed)


def case_kill_zygote(pool, workdir):
  # The zygote dies with both workers; only the killer is a crash, the innocent item that
  # was running on the other worker is re-run alone and scores.
  restarts = pool.totals["zygote_restarts"]
  out, score, elapsed = _beside_ten(pool, {"do": "kill_zygote"}, sleep=0.1)
  assert score == -1.0 and _counts(out) == {"crashes": 1}, (score, _counts(out), out.errors)
  assert out.metrics["verifier/failures"] == 1 and pool.totals["zygote_restarts"] > restarts
  assert elapsed < 15.0, elapsed


def case_huge_score(pool, workdir):
  out, score, _ = _beside_ten(pool, {"do": "huge_score"})
  assert score == -1.0 and _counts(out) == {"errors": 1}, (score, _counts(out))
  assert np.isfinite(out.rewards).all() and "float32" in out.errors[0]


def case_huge_int_info(pool, workdir):
  out, score, _ = _beside_ten(pool, {"do": "huge_int_info"})
  assert score == -1.0 and _counts(out) == {"errors": 1}, (score, _counts(out))
  assert "int64" in out.errors[0]


def case_daemon(pool, workdir):
  # The daemon dies when its item ends (the verifier returned normally).
  pidfile = os.path.join(workdir, "daemon.pid")
  out, score, _ = _beside_ten(pool, {"do": "daemon", "pidfile": pidfile})
  assert score == 1.0 and _counts(out) == {}, (score, _counts(out))
  pid = int(open(pidfile).read())
  deadline = time.monotonic() + 1.0
  while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.02)
  assert not _alive(pid), f"daemon {pid} outlived its item"


def case_daemon_then_hang(pool, workdir):
  # The item times out; its worker is killed and the daemon it left with it.
  pidfile = os.path.join(workdir, "daemon2.pid")
  out, score, _ = _beside_ten(pool, {"do": "daemon_then_hang", "pidfile": pidfile})
  assert score == -1.0 and _counts(out) == {"timeouts": 1}, (score, _counts(out))
  pid = int(open(pidfile).read())
  deadline = time.monotonic() + 3.0
  while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.02)
  assert not _alive(pid), f"daemon {pid} outlived its killed worker"


def case_fork_fallthrough(pool, workdir):
  # The forked child returns into the worker loop: it must not send a second reply.
  out, score, _ = _beside_ten(pool, {"do": "fork_fallthrough"})
  assert score == 1.0 and _counts(out) == {}, (score, _counts(out), out.errors)


def case_truncated_frame(pool, workdir):
  # Half a frame, then a hang: score() returns after the item timeout, not never.
  out, score, elapsed = _beside_ten(pool, {"do": "truncated_frame"})
  counts = _counts(out)
  assert score == -1.0 and sum(counts.values()) == 1 and set(counts) <= {"timeouts", "crashes"}, counts
  assert elapsed < TIMEOUT_S + 4.0, elapsed


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def run_case(pool: RewardPool, name: str, workdir: str, token: str) -> None:
  """One case, then: nothing of ours left but the pool, and the pool still scores."""
  CASES[name](pool, workdir)
  assert_nothing_left(pool, token)
  out = pool.score(["a"] * 4, [{}] * 4)
  assert out.components["v"].tolist() == [1.0] * 4 and out.metrics["verifier/failures"] == 0


def run_cases(names: list[str]) -> dict[str, str]:
  """Every case on one pool (for the unprivileged subprocess): name -> 'ok' or the failure."""
  token = os.environ[MARK]
  workdir = tempfile.mkdtemp()
  results = {}
  try:
    with RewardPool(RewardSpec.from_dict(SPEC)) as pool:
      for name in names:
        try:
          run_case(pool, name, workdir, token)
          results[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
          results[name] = f"{type(e).__name__}: {e}"
    try:
      assert_nothing_left(None, token)
      results["close"] = "ok"
    except AssertionError as e:
      results["close"] = str(e)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return results


# ---- in-process (root in CI) --------------------------------------------------------------


@pytest.fixture(scope="module")
def marked():
  token = f"{os.getpid()}-{time.monotonic_ns()}"
  old = os.environ.get(MARK)
  os.environ[MARK] = token
  yield token
  if old is None:
    os.environ.pop(MARK, None)
  else:
    os.environ[MARK] = old


@pytest.fixture(scope="module")
def pool(marked):
  with RewardPool(RewardSpec.from_dict(SPEC)) as p:
    yield p
  assert_nothing_left(None, marked)


@pytest.mark.parametrize("name", [n for n in CASES if n != "stderr_flood"])
def test_hostile_verifier_is_contained(pool, marked, name, tmp_path):
  guard = signal.signal(signal.SIGALRM, _too_slow)  # before the fix, a truncated frame hung forever
  signal.alarm(30)
  try:
    run_case(pool, name, str(tmp_path), marked)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, guard)


def _too_slow(*_):
  raise TimeoutError("score() did not return")


def test_stderr_flood_does_not_reach_the_trainer(capfd, tmp_path, monkeypatch):
  token = f"flood-{os.getpid()}-{time.monotonic_ns()}"  # apart from the module's pool
  monkeypatch.setenv(MARK, token)
  with RewardPool(RewardSpec.from_dict(SPEC)) as p:  # started here: its zygote inherits capfd's stderr
    run_case(p, "stderr_flood", str(tmp_path), token)
  err = capfd.readouterr().err
  assert len(err) < 1 << 16, f"{len(err)} bytes of worker stderr reached the trainer"


def test_info_and_scores_never_raise_inline():
  # Inline (num_workers=0) goes through the same checks: counted as errors, not raised.
  spec = dict(SPEC, num_workers=0)
  with RewardPool(RewardSpec.from_dict(spec)) as p:
    out = p.score(["x"] * 3, [{"do": "huge_int_info"}, {"do": "huge_score"}, {}])
  assert out.components["v"].tolist() == [-1.0, -1.0, 1.0] and out.metrics["verifier/errors"] == 2


# ---- as an unprivileged user -----------------------------------------------------------------


def unprivileged_python(env: dict[str, str]) -> tuple[str | None, str]:
  """An interpreter that uid NOBODY can run with rljax and numpy importable, or (None, why)."""
  if os.geteuid() != 0:
    return None, "not root: cannot switch to an unprivileged uid (the in-process tests already run unprivileged)"
  tried = []
  version = f"python{sys.version_info.major}.{sys.version_info.minor}"
  for cand in [sys.executable, os.path.realpath(sys.executable), f"/usr/bin/{version}", shutil.which(version),
               f"/usr/local/bin/{version}"]:
    if not cand or not os.path.exists(cand) or cand in tried:
      continue
    tried.append(cand)
    try:
      probe = subprocess.run([cand, "-c", "import numpy, rljax.rewards"], env=env, user=NOBODY, group=NOBODY,
                             extra_groups=[], capture_output=True, text=True, timeout=60, cwd="/")
    except OSError:  # e.g. under a home directory that uid NOBODY cannot enter
      continue
    if probe.returncode == 0:
      return cand, ""
  return None, f"no interpreter that uid {NOBODY} can run imports rljax here (tried {tried})"


def unprivileged_env(home: str, token: str = "") -> dict[str, str]:
  tests = os.path.dirname(os.path.abspath(__file__))
  paths = [os.path.dirname(tests), tests] + [p for p in sys.path if "-packages" in p]
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "PYTHONPATH": os.pathsep.join(paths),
         "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
  if token:
    env[MARK] = token
  return env


def nobody_dir() -> str:
  path = tempfile.mkdtemp(prefix="rljax-nobody-")
  os.chown(path, NOBODY, NOBODY)
  return path


def test_hostile_verifiers_as_unprivileged_user():
  home = nobody_dir()
  token = f"nobody-{os.getpid()}-{time.monotonic_ns()}"
  try:
    env = unprivileged_env(home, token)
    python, why = unprivileged_python(env)
    if python is None:
      print(f"skipped: {why}")
      pytest.skip(why)
    code = ("import json, test_rewards_hostile as t\n"
            f"print('RESULTS', json.dumps(t.run_cases({sorted(CASES)!r})))\n")
    with open(os.path.join(home, "stderr"), "wb") as err:
      proc = subprocess.run([python, "-c", code], env=env, user=NOBODY, group=NOBODY, extra_groups=[], cwd=home,
                            stdout=subprocess.PIPE, stderr=err, timeout=240)
    stderr_size = os.path.getsize(os.path.join(home, "stderr"))
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:],
                                            open(os.path.join(home, "stderr"), "rb").read(4000))
    results = json.loads(lines[-1].split(" ", 1)[1])
    assert results == {**{n: "ok" for n in CASES}, "close": "ok"}, results
    assert stderr_size < 1 << 16, f"{stderr_size} bytes of worker stderr reached the unprivileged trainer"
  finally:
    assert_nothing_left(None, token)
    shutil.rmtree(home, ignore_errors=True)
