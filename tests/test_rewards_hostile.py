"""Hostile verifiers through the public API (RewardSpec -> RewardPool -> score), each beside
innocent items on 2 workers: what they try is contained, the innocent items keep their exact
rewards (an innocent item scores 1.0 only in a worker no earlier item polluted), the counters are
exact, nothing they started keeps running and the pool works afterwards.

The cases run on one pool in-process (as root in CI); those whose containment depends on the
user (PRIVILEGE_CASES) again on one pool as an unprivileged uid in a subprocess
(`test_hostile_verifiers_as_unprivileged_user`), and some that do not need PID namespaces on one
pool of the fallback containment (`test_fallback_containment`): `run_cases` is shared. Every case
limits itself: a 2 s item timeout, 640 MB of address space per worker, a 30 s batch deadline, at
most ~200 MB of memory held, and a SIGALRM guard around each case.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from rljax.rewards import RewardPool, RewardResult, RewardSpec
from rljax.rewards.processes import process_state
from rljax.rewards.worker import CONTAINMENT_ENV

MARK = "RLJAX_HOSTILE_TEST"  # set in the environment the pool inherits: finds every process it made
POISON = "RLJAX_HOSTILE_POISON"
NOBODY = 65534
TIMEOUT_S = 2.0
SPEC = {"components": [{"name": "v", "verifier": "test_rewards_hostile:hostile"}],
        "timeout_s": TIMEOUT_S, "batch_deadline_s": 30.0, "fallback": -1.0, "num_workers": 2,
        "max_memory_mb": 640}
COUNTERS = ("timeouts", "errors", "crashes", "deadline_misses", "recycles", "info_errors", "import_timeouts")
_HOARD: list = []  # what hostile items leave in their worker's memory (innocent items check it is empty)

# ---- the verifier (module level: workers import it by reference) -----------------------------


def _host_pid() -> int:
  return int(os.readlink("/proc/self"))  # in a worker's PID namespace os.getpid() is 1


def _daemonize(pidfile: str, then=None) -> None:
  """Double fork + setsid: a grandchild that writes its pid, runs `then` and sleeps, adopted away."""
  r, w = os.pipe()
  child = os.fork()
  if child == 0:
    os.setsid()
    if os.fork() == 0:
      with open(pidfile, "w") as f:
        f.write(str(_host_pid()))
      os.write(w, b"x")
      for _ in range(200):
        if then is not None:
          then()
        time.sleep(0.05)
      os._exit(0)
    os._exit(0)
  os.waitpid(child, 0)
  os.read(r, 1)
  os.close(r)
  os.close(w)


def _try_kill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except OSError:
    pass


def _clone_parent(pidfile: str) -> None:
  """clone(CLONE_PARENT): a child of our parent, not ours; it writes its pid and sleeps."""
  libc = ctypes.CDLL(None, use_errno=True)
  pid = libc.syscall(56, 0x00008000 | signal.SIGCHLD, 0, 0, 0, 0)  # x86_64 clone(CLONE_PARENT | SIGCHLD)
  if pid == 0:
    try:
      with open(pidfile, "w") as f:
        f.write(str(_host_pid()))
      time.sleep(100)
    finally:
      os._exit(0)


class SlowUnpickle:
  """Unpickling this sleeps 20 s (pickle would run that in the trainer)."""

  def __reduce__(self):
    return time.sleep, (20,)


def pollution(example) -> str | None:
  """What an earlier item left in this worker that would break this item (None: nothing)."""
  for fd in (0, 1, 2):
    try:
      os.fstat(fd)
    except OSError:
      return f"fd {fd} is closed"
  if len(os.listdir("/proc/self/fd")) > 32:
    return "leaked file descriptors"
  try:
    if example.get("cwd") and os.getcwd() != example["cwd"]:
      return "another working directory"
  except OSError:
    return "the working directory is gone"
  with open("/proc/self/status") as f:
    threads = [int(line.split()[1]) for line in f if line.startswith("Threads:")][0]
  if threads != 1:
    return f"{threads} threads"
  if signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0):
    return "an armed interval timer"
  if signal.getsignal(signal.SIGCHLD) != signal.SIG_DFL:
    return "SIGCHLD is not default"
  if os.environ.get(POISON):
    return "a poisoned environment"
  if _HOARD:
    return "memory held by an earlier item"
  return None


def hostile(completion, example):
  """Misbehaves as example['do'] says; otherwise sleeps example['sleep'] and scores 1.0 in a
  clean worker (0.0 with the pollution it found)."""
  do = example.get("do")
  if do == "stderr_flood":  # 100 MB, written straight to fd 2 (cheap, so it never nears the timeout)
    chunk = b"x" * (1 << 20)
    for _ in range(100):
      os.write(2, chunk)
  elif do == "kill_zygote":  # its parent, and the zygote by the pid the trainer sees
    if os.getppid() > 1:
      _try_kill(os.getppid())
    _try_kill(example["zygote"])
    time.sleep(0.3)
  elif do == "huge_score":
    return 1e300
  elif do == "huge_int_info":
    return RewardResult(1.0, {"n": 2**64})
  elif do == "slow_unpickle_info":
    return RewardResult(1.0, {"ok": 1, "trap": SlowUnpickle(), "fn": lambda: None})
  elif do == "huge_info":
    return RewardResult(1.0, {"blob": "x" * (20 << 20)})
  elif do == "daemon":
    _daemonize(example["pidfile"])
  elif do == "daemon_then_hang":
    _daemonize(example["pidfile"])
    time.sleep(1000)
  elif do == "daemon_kills_zygote":  # clears the worker's subreaper flag, then a daemon goes for the zygote
    ctypes.CDLL(None).prctl(36, 0, 0, 0, 0)
    _daemonize(example["pidfile"], then=lambda: _try_kill(example["zygote"]))
  elif do == "clone_parent":  # from the worker and from a child of it
    _clone_parent(example["pidfile"] + ".w")
    child = os.fork()
    if child == 0:
      try:
        _clone_parent(example["pidfile"])
      finally:
        os._exit(0)
    os.waitpid(child, 0)
    while not os.path.exists(example["pidfile"]):
      time.sleep(0.01)
  elif do == "fork_fallthrough":  # the child returns into the worker's loop
    if os.fork():
      time.sleep(0.1)
  elif do == "truncated_frame":  # half a frame onto the pool's socket, then hang
    for fd in map(int, os.listdir("/proc/self/fd")):
      try:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
          os.write(fd, struct.pack("!Q", 1000) + b"x" * 10)
      except OSError:
        pass
    time.sleep(1000)
  elif do == "lazy_import":  # a module the zygote did not preload, whose import takes too long
    sys.path.insert(0, example["dir"])
    importlib.import_module(example["module"])
  elif do == "plain":  # scores without checking its worker (inline: the trainer's own process)
    pass
  elif do == "sleep_long":
    time.sleep(1000)
  elif do == "close_std":
    for fd in (0, 1, 2):
      os.close(fd)
  elif do == "chdir_removed":
    path = tempfile.mkdtemp()
    os.chdir(path)
    os.rmdir(path)
  elif do == "leak_fds":
    _HOARD.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(64))
  elif do == "spinning_thread":
    threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
  elif do == "itimer":  # SIGALRM's default action would kill whatever item runs next
    signal.setitimer(signal.ITIMER_REAL, 0.5)
  elif do == "ignore_sigchld":  # later items' subprocesses would be reaped away (ECHILD)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
  elif do == "poison_env":
    os.environ[POISON] = "1"
  elif do == "leak_memory":  # resident, just past the pool's bound (rljax.rewards.pool: a share of max_memory_mb)
    _HOARD.append(b"\x01" * (int(example["mb"]) << 20))
  else:
    time.sleep(example.get("sleep", 0.0))
    why = pollution(example)
    return 1.0 if why is None else RewardResult(0.0, {"dirty": why})
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
  return process_state(pid) != "dead"


def _wait_dead(pid: int, wait_s: float = 3.0) -> bool:
  deadline = time.monotonic() + wait_s
  while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.02)
  return not _alive(pid)


def assert_nothing_left(pool: RewardPool | None, token: str, extra_pids=(), wait_s: float = 3.0) -> None:
  """No process of ours other than the pool's own (none once it is closed)."""
  deadline = time.monotonic() + wait_s
  while True:
    allowed = pool.process_ids() if pool is not None and not pool._closed else set()
    strays = (_marked_processes(token) - allowed) | {p for p in extra_pids if _alive(p)}
    if not strays or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert not strays, f"left running: {sorted(strays)}"


# ---- the cases ------------------------------------------------------------------------------


def _innocent(sleep: float = 0.0) -> dict:
  return {"sleep": sleep, "cwd": os.getcwd()}


def _beside_ten(pool: RewardPool, example: dict, sleep: float = 0.0):
  examples = [_innocent(sleep)] * 5 + [example] + [_innocent(sleep)] * 5
  start = time.monotonic()
  out = pool.score(["x"] * 11, examples)
  elapsed = time.monotonic() - start
  scores = out.components["v"].tolist()
  assert scores[:5] + scores[6:] == [1.0] * 10, (scores, out.infos["v"], out.errors)
  return out, scores[5], elapsed


def _counts(out) -> dict[str, int]:
  return {k: int(out.metrics[f"verifier/{k}"]) for k in COUNTERS if out.metrics[f"verifier/{k}"]}


def _namespaced(pool: RewardPool) -> bool:
  return pool.containment == "pid-namespace"


def case_stderr_flood(pool, workdir):
  # 100 MB to stderr: the score comes back (the caller checks that the bytes did not).
  out, score, elapsed = _beside_ten(pool, {"do": "stderr_flood"})
  assert score == 1.0 and _counts(out) == {} and elapsed < 5.0, (score, _counts(out), elapsed)


def case_state_leaks(pool, workdir):
  # Items that change their worker's process state, each followed by innocent items: the worker is
  # replaced after each (verifier/recycles), the hostile items keep their scores, no innocent one
  # sees the state.
  leaks = ["close_std", "chdir_removed", "leak_fds", "spinning_thread", "itimer", "ignore_sigchld", "poison_env",
           "leak_memory"]
  examples = []
  for do in leaks:
    examples += [{"do": do, "mb": pool._rss_mb() + 40}] + [_innocent()] * 3
  out = pool.score(["x"] * len(examples), examples)
  scores = out.components["v"].tolist()
  assert scores == [1.0] * len(examples), [(e.get("do"), s, i) for e, s, i in zip(examples, scores, out.infos["v"])
                                           if s != 1.0]
  assert _counts(out) == {"recycles": len(leaks)}, (_counts(out), out.errors)


def case_kill_zygote(pool, workdir):
  # With namespaces the verifier cannot reach the zygote (nor its parent, which is outside its
  # namespace). Without, the zygote dies with both workers; only the killer is a crash, the
  # innocent item that was running on the other worker is re-run alone and scores.
  restarts, zygote = pool.totals["zygote_restarts"], pool._zygote.pid
  out, score, elapsed = _beside_ten(pool, {"do": "kill_zygote", "zygote": zygote}, sleep=0.1)
  if _namespaced(pool):
    assert score == 1.0 and _counts(out) == {} and pool._zygote.pid == zygote and _alive(zygote), _counts(out)
    return
  assert score == -1.0 and _counts(out) == {"crashes": 1}, (score, _counts(out), out.errors)
  assert out.metrics["verifier/failures"] == 1 and pool.totals["zygote_restarts"] > restarts
  assert elapsed < 15.0, elapsed


def case_zygote_killed(pool, workdir):
  # The zygote is killed from outside in the middle of a batch: its workers die with it, a new one
  # starts, and every item that was running is re-run: none is convicted, all score.
  restarts, zygote = pool.totals["zygote_restarts"], pool._zygote.pid
  timer = threading.Timer(0.3, _try_kill, (zygote,))
  timer.start()
  try:
    out, score, _ = _beside_ten(pool, _innocent(0.2), sleep=0.2)
  finally:
    timer.join()
  assert score == 1.0 and _counts(out) == {}, (_counts(out), out.errors)
  assert pool.totals["zygote_restarts"] == restarts + 1 and _wait_dead(zygote)


def case_zygote_stopped(pool, workdir):
  # SIGSTOP to the zygote in the middle of a batch whose worker must be replaced (an item times
  # out): the stopped zygote is seen (its state, not its existence), killed and replaced at once.
  restarts, zygote = pool.totals["zygote_restarts"], pool._zygote.pid
  timer = threading.Timer(0.3, os.kill, (zygote, signal.SIGSTOP))
  timer.start()
  try:
    out, score, elapsed = _beside_ten(pool, {"do": "sleep_long"}, sleep=0.1)
  finally:
    timer.join()
  assert score == -1.0 and _counts(out) == {"timeouts": 1}, (_counts(out), out.errors)
  assert elapsed < TIMEOUT_S + 6.0, elapsed
  pool.score(["a"], [{}])  # where the stop came after the last spawn, the next batch replaces it
  assert pool.totals["zygote_restarts"] == restarts + 1 and _wait_dead(zygote)


def case_huge_score(pool, workdir):
  out, score, _ = _beside_ten(pool, {"do": "huge_score"})
  assert score == -1.0 and _counts(out) == {"errors": 1}, (score, _counts(out))
  assert np.isfinite(out.rewards).all() and "float32" in out.errors[0]


def case_huge_int_info(pool, workdir):
  out, score, _ = _beside_ten(pool, {"do": "huge_int_info"})
  assert score == -1.0 and _counts(out) == {"errors": 1}, (score, _counts(out))
  assert "int64" in out.errors[0]


def case_slow_unpickle_info(pool, workdir):
  # Replies are JSON: an info value that is not plain data is dropped in the worker (counted), the
  # score and the plain values are kept, and nothing of it runs in the trainer.
  out, score, elapsed = _beside_ten(pool, {"do": "slow_unpickle_info"})
  assert score == 1.0 and _counts(out) == {"info_errors": 1} and elapsed < 5.0, (_counts(out), elapsed)
  assert out.infos["v"][5] == {"ok": 1} and "not plain data" in out.errors[0], (out.infos["v"][5], out.errors)


def case_huge_info(pool, workdir):
  out, score, _ = _beside_ten(pool, {"do": "huge_info"})
  assert score == 1.0 and _counts(out) == {"info_errors": 1} and out.infos["v"][5] is None, _counts(out)


def case_daemon(pool, workdir):
  # The daemon dies when its item ends (the verifier returned normally).
  pidfile = os.path.join(workdir, "daemon.pid")
  out, score, _ = _beside_ten(pool, {"do": "daemon", "pidfile": pidfile})
  assert score == 1.0 and _counts(out) == {}, (score, _counts(out))
  pid = int(open(pidfile).read())
  assert _wait_dead(pid, 1.0), f"daemon {pid} outlived its item"


def case_daemon_then_hang(pool, workdir):
  # The item times out; its worker is killed and the daemon it left with it.
  pidfile = os.path.join(workdir, "daemon2.pid")
  out, score, _ = _beside_ten(pool, {"do": "daemon_then_hang", "pidfile": pidfile})
  assert score == -1.0 and _counts(out) == {"timeouts": 1}, (score, _counts(out))
  pid = int(open(pidfile).read())
  assert _wait_dead(pid), f"daemon {pid} outlived its killed worker"


def case_daemon_kills_zygote(pool, workdir):
  # A daemon of a worker that cleared its subreaper flag goes for the zygote: it cannot see it, and
  # it dies with its item (needs PID namespaces).
  pidfile = os.path.join(workdir, "daemon3.pid")
  zygote = pool._zygote.pid
  out, score, _ = _beside_ten(pool, {"do": "daemon_kills_zygote", "pidfile": pidfile, "zygote": zygote})
  assert score == 1.0 and _counts(out) == {}, (score, _counts(out), out.errors)
  assert _wait_dead(int(open(pidfile).read()), 1.0) and pool._zygote.pid == zygote and _alive(zygote)


def case_clone_parent(pool, workdir):
  # clone(CLONE_PARENT) makes a sibling instead of a child, out of its maker's sight: from the
  # worker (a child of its namespace's init) and from a child of the worker. Both are in the
  # worker's PID namespace and die with the item (needs PID namespaces).
  pidfile = os.path.join(workdir, "clone.pid")
  out, score, _ = _beside_ten(pool, {"do": "clone_parent", "pidfile": pidfile})
  assert score == 1.0 and _counts(out) == {}, (score, _counts(out), out.errors)
  for path in (pidfile, pidfile + ".w"):
    deadline = time.monotonic() + 1.0
    while not os.path.exists(path) and time.monotonic() < deadline:
      time.sleep(0.01)
    if os.path.exists(path):  # a clone that did run
      assert _wait_dead(int(open(path).read()), 1.0), f"the clone of {path} outlived its item"


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


def case_lazy_import(pool, workdir):
  # A verifier that imports a slow module on its first call times out in every new worker; the
  # error says which import and what to do.
  module = f"rljax_slow_import_{os.getpid()}_{time.monotonic_ns()}"
  with open(os.path.join(workdir, module + ".py"), "w") as f:
    f.write("import time\ntime.sleep(60)\n")
  out, score, _ = _beside_ten(pool, {"do": "lazy_import", "dir": workdir, "module": module})
  assert score == -1.0 and _counts(out) == {"timeouts": 1, "import_timeouts": 1}, (_counts(out), out.errors)
  assert f"importing '{module}'" in out.errors[0] and "preload" in out.errors[0], out.errors


NAMESPACE_ONLY = {"daemon_kills_zygote", "clone_parent"}  # escapes the subreaper fallback cannot contain
# The cases whose containment depends on the user (namespaces as root or through a user namespace,
# uid switches, signals): the unprivileged run repeats these; the others test the pool's own code.
PRIVILEGE_CASES = ["clone_parent", "daemon", "daemon_kills_zygote", "daemon_then_hang", "kill_zygote", "state_leaks",
                   "stderr_flood", "zygote_killed", "zygote_stopped"]
CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def run_case(pool: RewardPool, name: str, workdir: str, token: str) -> None:
  """One case, then: nothing of ours left but the pool, and the pool still scores."""
  if name in NAMESPACE_ONLY and not _namespaced(pool):
    return
  CASES[name](pool, workdir)
  assert_nothing_left(pool, token)
  out = pool.score(["a"] * 4, [_innocent()] * 4)
  assert out.components["v"].tolist() == [1.0] * 4 and out.metrics["verifier/failures"] == 0


def run_cases(names: list[str]) -> dict[str, str]:
  """Every case on one pool (for the subprocesses): name -> 'ok' or the failure; 'containment'."""
  token = os.environ[MARK]
  workdir = tempfile.mkdtemp()
  results = {}
  try:
    with RewardPool(RewardSpec.from_dict(SPEC)) as pool:
      results["containment"] = pool.containment
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


def _guarded(fn, *args) -> None:
  guard = signal.signal(signal.SIGALRM, _too_slow)  # a case that hangs fails instead
  signal.alarm(45)
  try:
    fn(*args)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, guard)


@pytest.mark.parametrize("name", [n for n in CASES if n != "stderr_flood"])
def test_hostile_verifier_is_contained(pool, marked, name, tmp_path):
  if pool.containment != "pid-namespace":
    print(f"note: no PID namespace here ({pool._zygote.note}); namespace-only cases are skipped")
  _guarded(run_case, pool, name, str(tmp_path), marked)


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
  # Inline (num_workers=0) goes through the same checks: counted as errors, not raised; info
  # values that are not plain data are dropped the same way.
  spec = dict(SPEC, num_workers=0)
  with RewardPool(RewardSpec.from_dict(spec)) as p:
    out = p.score(["x"] * 4, [{"do": "huge_int_info"}, {"do": "huge_score"}, {"do": "slow_unpickle_info"},
                              {"do": "plain"}])
  assert out.components["v"].tolist() == [-1.0, -1.0, 1.0, 1.0] and out.metrics["verifier/errors"] == 2
  assert out.metrics["verifier/info_errors"] == 1 and out.infos["v"][2] == {"ok": 1}


def test_fallback_containment(monkeypatch, tmp_path):
  # Without PID namespaces (forced here; e.g. a container that forbids unshare) the pool says so,
  # and every case but the namespace-only escapes is still contained.
  token = f"fallback-{os.getpid()}-{time.monotonic_ns()}"
  monkeypatch.setenv(MARK, token)
  monkeypatch.setenv(CONTAINMENT_ENV, "subreaper")
  with RewardPool(RewardSpec.from_dict(SPEC)) as p:
    assert p.containment == "subreaper"
    for name in ["state_leaks", "kill_zygote", "daemon", "daemon_then_hang", "fork_fallthrough"]:
      _guarded(run_case, p, name, str(tmp_path), token)
  assert_nothing_left(None, token)


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
            f"print('RESULTS', json.dumps(t.run_cases({sorted(PRIVILEGE_CASES)!r})))\n")
    with open(os.path.join(home, "stderr"), "wb") as err:
      proc = subprocess.run([python, "-c", code], env=env, user=NOBODY, group=NOBODY, extra_groups=[], cwd=home,
                            stdout=subprocess.PIPE, stderr=err, timeout=300)
    stderr_size = os.path.getsize(os.path.join(home, "stderr"))
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:],
                                            open(os.path.join(home, "stderr"), "rb").read(4000))
    results = json.loads(lines[-1].split(" ", 1)[1])
    containment = results.pop("containment")
    print(f"containment as uid {NOBODY}: {containment}")
    assert results == {**{n: "ok" for n in PRIVILEGE_CASES}, "close": "ok"}, results
    assert stderr_size < 1 << 16, f"{stderr_size} bytes of worker stderr reached the unprivileged trainer"
    with open("/proc/sys/user/max_user_namespaces") as f:
      userns_allowed = int(f.read()) > 0
    if userns_allowed:  # then the pool must have used them (else the namespace-only cases were skipped)
      assert containment == "pid-namespace", containment
  finally:
    assert_nothing_left(None, token)
    shutil.rmtree(home, ignore_errors=True)
