"""The worker pool: correct results across the process boundary, and adversarial inputs that
must finish in bounded time with the fallback reward and leave nothing running."""
import ctypes
import glob
import logging
import os
import signal
import tempfile
import time

import numpy as np
import pytest

from rljax.rewards import RewardPool, RewardResult, RewardSpec, pool as pool_module, sandbox

# ---- adversarial verifiers (module level: workers import them by reference) -----------------


def adversary(completion, example):
  """Misbehaves as example['do'] says; otherwise scores 1.0."""
  do = example.get("do")
  if do == "raise":
    raise RuntimeError("verifier exploded")
  if do == "sleep":
    time.sleep(10**6)
  if do == "spin":
    while True:
      pass
  if do == "segfault":
    ctypes.string_at(0)
  if do == "alloc":
    blob = bytearray(10 * 2**30)
    return float(len(blob))
  if do == "print":
    print("x" * 100_000_000)
  if do == "kill_parent":  # the worker's parent is the pool's zygote
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(5)
  if do == "exit":
    os._exit(3)
  if do == "nan":
    return float("nan")
  if do == "unpicklable_info":
    return RewardResult(0.5, {"callback": lambda: None})
  return 1.0


# ---- helpers ----------------------------------------------------------------------------------


def _procs():
  out = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/status") as f:
        fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    except OSError:
      continue
    out[int(entry)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]), fields["State"].split()[0])
  return out


def _descendants(root):
  procs = _procs()
  found, frontier = set(), [root]
  while frontier:
    parent = frontier.pop()
    for pid, (ppid, _, state) in procs.items():
      if ppid == parent and pid not in found:
        found.add(pid)
        frontier.append(pid)
  return {pid for pid in found if procs.get(pid, (0, 0, "Z"))[2] != "Z"}


def _sandbox_processes():
  return {pid for pid, (_, uid, state) in _procs().items()
          if sandbox.UID_BASE <= uid < sandbox.UID_BASE + sandbox.UID_SPAN and state != "Z"}


def _pool_pids():
  """The zygotes and workers of every open pool (module-scoped pools stay open across tests)."""
  pids = set()
  for pool in list(pool_module._LIVE_POOLS):
    if pool._closed:
      continue
    pids |= pool.process_ids()
  return pids


def assert_nothing_left(wait_s=5.0):
  """No sandboxed process and no descendant of this process other than open pools' own."""
  deadline = time.monotonic() + wait_s
  while True:
    strays = (_descendants(os.getpid()) - _pool_pids()) | _sandbox_processes()
    if not strays or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert not strays, {pid: _procs().get(pid) for pid in strays}


@pytest.fixture(scope="module")
def adv_pool():
  spec = RewardSpec.from_dict({
      "components": [{"name": "adv", "verifier": "test_rewards_pool:adversary"}],
      "timeout_s": 1.0, "batch_deadline_s": 30.0, "fallback": -1.0, "num_workers": 2, "max_memory_mb": 1024})
  with RewardPool(spec) as pool:
    yield pool


@pytest.fixture(scope="module")
def code_pool():
  spec = RewardSpec.from_dict({
      "components": [{"name": "code", "verifier": "code", "kwargs": {"timeout_s": 1.0}}],
      "timeout_s": 5.0, "fallback": 0.0, "num_workers": 2})
  with RewardPool(spec) as pool:
    yield pool


@pytest.fixture(scope="module")
def math_pool():
  spec = RewardSpec.from_dict({"components": [{"name": "correct", "verifier": "math"}],
                               "timeout_s": 2.0, "fallback": -1.0, "num_workers": 2})
  with RewardPool(spec) as pool:
    yield pool


# ---- results across the process boundary ------------------------------------------------------


def test_pool_matches_expected_math_results(math_pool):
  from test_rewards_verifiers import MATH_CASES
  cases = MATH_CASES[::3]
  out = math_pool.score([c for _, c, _ in cases], [{"answer": g} for g, _, _ in cases])
  np.testing.assert_array_equal(out.components["correct"], [float(e) for _, _, e in cases])
  assert out.metrics["verifier/failures"] == 0 and out.errors == []
  assert out.rewards.dtype == np.float32 and out.rewards.shape == (len(cases),)


def test_pathological_latex_times_out_and_others_still_score(math_pool):
  nested = "\\boxed{" + "(" * 40 + "1" + ")" * 40 + "}"
  start = time.monotonic()
  out = math_pool.score(["\\boxed{2}", nested, "\\boxed{3}"], [{"answer": "2"}, {"answer": "1"}, {"answer": "2"}])
  assert time.monotonic() - start < 2.0 + 4.0
  np.testing.assert_array_equal(out.components["correct"], [1.0, -1.0, 0.0])
  assert out.metrics["verifier/timeouts"] == 1
  assert_nothing_left()


# ---- adversarial verifiers --------------------------------------------------------------------


@pytest.mark.parametrize("do,counter", [
    ("raise", "verifier/errors"),
    ("nan", "verifier/errors"),
    ("sleep", "verifier/timeouts"),
    ("spin", "verifier/timeouts"),
    ("segfault", "verifier/crashes"),
    ("exit", "verifier/crashes"),
    ("alloc", "verifier/errors"),
])
def test_adversarial_verifier_gets_fallback(adv_pool, do, counter, caplog):
  start = time.monotonic()
  with caplog.at_level(logging.WARNING, logger="rljax.rewards"):
    out = adv_pool.score(["ok", "bad", "ok"], [{}, {"do": do}, {}])
  assert time.monotonic() - start < 1.0 + 4.0
  np.testing.assert_array_equal(out.components["adv"], [1.0, -1.0, 1.0])
  np.testing.assert_array_equal(out.rewards, [1.0, -1.0, 1.0])
  assert out.metrics[counter] == 1 and out.metrics["verifier/failures"] == 1
  assert len(out.errors) == 1
  assert_nothing_left()
  # The pool keeps working (replaced workers included).
  assert adv_pool.score(["a", "b", "c"], [{}] * 3).components["adv"].tolist() == [1.0] * 3


def test_unpicklable_info_keeps_the_score(adv_pool):
  out = adv_pool.score(["x"], [{"do": "unpicklable_info"}])
  assert out.components["adv"].tolist() == [0.5] and out.metrics["verifier/failures"] == 0
  assert out.metrics["verifier/info_errors"] == 1 and out.infos["adv"][0] == {}


def test_verifier_errors_are_logged(adv_pool, caplog):
  adv_pool._logged = 0
  with caplog.at_level(logging.WARNING, logger="rljax.rewards"):
    out = adv_pool.score(["x"], [{"do": "raise"}])
  assert "verifier exploded" in out.errors[0]
  assert any("verifier exploded" in r.getMessage() for r in caplog.records)


def test_huge_print_in_verifier_is_discarded(adv_pool):
  start = time.monotonic()
  out = adv_pool.score(["x"], [{"do": "print"}])
  assert time.monotonic() - start < 5.0
  assert out.components["adv"].tolist() in ([1.0], [-1.0])
  assert_nothing_left()


def test_verifier_that_kills_its_parent(adv_pool):
  # With PID namespaces its parent is outside its namespace (getppid() is 0): the kill reaches
  # nobody, the item times out. Without, the zygote dies and is replaced.
  restarts = adv_pool.totals["zygote_restarts"]
  start = time.monotonic()
  out = adv_pool.score(["ok", "bad"], [{}, {"do": "kill_parent"}])
  assert time.monotonic() - start < 1.0 + 4.0
  assert out.components["adv"].tolist() == [1.0, -1.0]
  assert_nothing_left()
  out = adv_pool.score(["a"] * 4, [{}] * 4)
  assert out.components["adv"].tolist() == [1.0] * 4
  if adv_pool.containment == "pid-namespace":
    assert adv_pool.totals["zygote_restarts"] == restarts and out.metrics["verifier/timeouts"] == 0
  else:
    assert adv_pool.totals["zygote_restarts"] > restarts


def test_batch_deadline_returns_in_time():
  spec = RewardSpec.from_dict({"components": [{"name": "adv", "verifier": "test_rewards_pool:adversary"}],
                               "timeout_s": 30.0, "batch_deadline_s": 1.5, "fallback": -1.0, "num_workers": 2})
  with RewardPool(spec) as pool:
    start = time.monotonic()
    out = pool.score(["x"] * 5, [{"do": "sleep"}] * 4 + [{}])
    elapsed = time.monotonic() - start
    assert 1.4 < elapsed < 1.5 + 3.0
    assert out.metrics["verifier/deadline_misses"] >= 4
    assert (out.components["adv"][:4] == -1.0).all()
    assert_nothing_left()
    assert pool.score(["x"], [{}]).components["adv"].tolist() == [1.0]
  assert_nothing_left()


def test_close_leaves_no_processes():
  before = _descendants(os.getpid())
  spec = RewardSpec.from_dict({"components": [{"name": "code", "verifier": "code"}], "num_workers": 2})
  pool = RewardPool(spec)
  assert len(_descendants(os.getpid()) - before) >= 3  # the zygote and two workers
  background = "```python\nimport os, time\nif os.fork() == 0:\n  time.sleep(1000)\nprint(1)\n```"
  assert pool.score([background], [{"tests": [{"input": "", "output": "1"}]}]).rewards.tolist() == [1.0]
  pool.close()
  pool.close()  # idempotent
  deadline = time.monotonic() + 5
  while (_descendants(os.getpid()) - before or _sandbox_processes()) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _descendants(os.getpid()) - before
  assert not _sandbox_processes()
  with pytest.raises(RuntimeError, match="close"):
    pool.score(["x"], [{}])


# ---- adversarial code in the sandbox ----------------------------------------------------------

ADD = {"tests": [{"input": "2 3\n", "output": "5\n"}]}
PROGRAMS = {
    "infinite_loop": "while True:\n  pass",
    "fork_bomb": "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass",
    "fork_bomb_escaping_session": ("import os, time\nfor _ in range(50):\n  try:\n    if os.fork() == 0:\n"
                                   "      os.setsid()\n      while True:\n        time.sleep(1)\n"
                                   "  except OSError:\n    pass\nwhile True:\n  pass"),
    "allocate_10gb": "blob = bytearray(10 * 2**30)\nprint(5)",
    "print_100mb": "import sys\nsys.stdout.write('x' * 100_000_000)\nprint(5)",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(5)",
    "kill_everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\nwhile True:\n  pass",
    "segfault": "import ctypes\nctypes.string_at(0)",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint(5)",
    "write_outside": "open('/etc/rljax_sandbox_probe', 'w').write('x')\nprint(5)",
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_adversarial_code_is_contained(code_pool, name):
  completion = f"```python\n{PROGRAMS[name]}\n```"
  start = time.monotonic()
  out = code_pool.score([completion, "```python\nprint(sum(map(int, input().split())))\n```"], [ADD, ADD])
  assert time.monotonic() - start < 1.0 + 5.0
  # kill_parent prints the right answer once its kill fails (EPERM as a private uid) or is
  # ignored (its parent is its PID namespace's init); what matters is that nothing else died.
  first = [0.0, 1.0] if name == "kill_parent" else [0.0]
  assert out.components["code"][0] in first and out.components["code"][1] == 1.0, out.components
  assert_nothing_left()
  assert not os.path.exists("/etc/rljax_sandbox_probe")


def test_sandbox_cannot_read_private_files(code_pool, tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_text("5")
  secret.chmod(0o600)
  if not sandbox.isolation().isolated:
    pytest.skip(f"the sandbox cannot isolate here: {sandbox.isolation().note}")
  completion = f"```python\nprint(open({str(secret)!r}).read())\n```"
  assert code_pool.score([completion], [ADD]).components["code"].tolist() == [0.0]
  # System files stay readable (documented: system directories are bound read-only).
  res = sandbox.run_python("print(len(open('/etc/hostname').read()) > 0)")
  assert res.ok and res.stdout.strip() == "True"


def test_sandbox_limits_and_isolation_facts():
  facts = sandbox.describe()
  if os.geteuid() == 0:
    assert facts["uid_switch"], facts
  res = sandbox.run_python("import resource\nprint(resource.getrlimit(resource.RLIMIT_NPROC)[0], "
                           "resource.getrlimit(resource.RLIMIT_FSIZE)[0] >> 20)",
                           limits=sandbox.SandboxLimits(max_processes=7, file_size_mb=3))
  assert res.stdout.split() == ["7", "3"]
  res = sandbox.run_python("print('y' * 10000)", limits=sandbox.SandboxLimits(max_output_bytes=100))
  assert res.ok and res.truncated and len(res.stdout) == 100


def test_pool_timeout_kills_a_running_sandbox():
  # The code verifier would wait 30 s per test; the pool's 1 s item timeout kills the worker
  # in the middle of the sandboxed run, and the sandbox's processes must die with it.
  spec = RewardSpec.from_dict({"components": [{"name": "code", "verifier": "code", "kwargs": {"timeout_s": 30.0}}],
                               "timeout_s": 1.0, "fallback": -1.0, "num_workers": 1})
  program = PROGRAMS["fork_bomb_escaping_session"]
  with RewardPool(spec) as pool:
    staged = os.path.join(tempfile.gettempdir(), f"rljax-sbx-{pool._zygote.pid}w*")  # workers' tags start so
    start = time.monotonic()
    out = pool.score([f"```python\n{program}\n```"], [ADD])
    assert time.monotonic() - start < 1.0 + 4.0
    assert out.components["code"].tolist() == [-1.0] and out.metrics["verifier/timeouts"] == 1
    assert_nothing_left()
    deadline = time.monotonic() + 5  # the killed worker's staged program is removed too
    while glob.glob(staged) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not glob.glob(staged)
  assert_nothing_left()
