"""What sandboxed model code can and cannot do: the table in docs/rewards.md, row by row.

Every check runs in-process (as root in CI: `test_sandbox_in_process`) and, in one subprocess,
as an unprivileged uid (`test_sandbox_as_unprivileged_user`), where the isolation comes from an
unprivileged user namespace. `run_checks` is shared by both.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import pytest
from test_rewards_hostile import CASES as HOSTILE_CASES, NOBODY, nobody_dir, unprivileged_env, unprivileged_python

from rljax.errors import ConfigError
from rljax.rewards import RewardPool, RewardSpec, sandbox

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = sandbox.SandboxLimits(timeout_s=3.0)


def _run(source: str, limits: sandbox.SandboxLimits = LIMITS) -> sandbox.SandboxResult:
  return sandbox.run_python(source, limits=limits)


def _json_out(source: str, limits: sandbox.SandboxLimits = LIMITS) -> object:
  res = _run("import json, os\n" + source, limits)
  assert res.ok, (res.returncode, res.stderr[-2000:])
  return json.loads(res.stdout.strip().splitlines()[-1])


def _by_comm(name: str) -> set[int]:
  """Live processes whose name (comm) is `name`."""
  found = set()
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    comm, state = stat[stat.index(b"(") + 1:stat.rindex(b")")], stat[stat.rindex(b")") + 2:].split()[0]
    if comm == name.encode() and state not in (b"Z", b"X"):
      found.add(int(entry))
  return found


def _none_left(comm: str, wait_s: float = 3.0) -> None:
  deadline = time.monotonic() + wait_s
  while _by_comm(comm) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _by_comm(comm), f"sandboxed processes named {comm} outlived the run"


_NAME = "import ctypes\nctypes.CDLL(None).prctl(15, {comm!r}.encode(), 0, 0, 0)\n"  # PR_SET_NAME

# ---- the checks (ctx: paths and a port prepared by the caller) ------------------------------


def check_no_network(ctx):
  # No interface but a down loopback: not even the caller's listener on 127.0.0.1 is reachable.
  got = _json_out(f"""import socket
try:
  socket.create_connection(("127.0.0.1", {ctx['port']}), timeout=1)
  print(json.dumps("connected"))
except OSError as e:
  print(json.dumps(e.errno))""")
  assert got != "connected", got


def check_user_files_invisible(ctx):
  # The caller's private file, its home and the project tree are not in the sandbox's root.
  got = _json_out(f"print(json.dumps([os.path.exists(p) for p in {[ctx['secret'], ctx['home'], PROJECT]!r}]))")
  assert got == [False, False, False], got


def check_real_home_shows_only_the_interpreter(ctx):
  # Of the user's real home, at most the directories leading to the interpreter (read-only).
  home = os.path.realpath(os.path.expanduser("~"))
  got = _json_out(f"print(json.dumps(sorted(os.listdir({home!r})) if os.path.isdir({home!r}) else []))")
  python = sandbox.isolation().python
  allowed = {os.path.relpath(python, home).split(os.sep)[0]} if python.startswith(home + os.sep) else set()
  assert set(got) <= allowed, (got, allowed)


def check_project_not_writable(ctx):
  target = os.path.join(PROJECT, f"rljax_sandbox_probe_{secrets.token_hex(4)}")
  res = _run(f"open({target!r}, 'w').write('x')")
  assert not res.ok and not os.path.exists(target), res.stderr[-500:]


def check_private_tmp(ctx):
  # The host's /tmp is not visible, and what the code writes to /tmp stays in the run.
  mine = f"rljax_sandbox_tmp_{secrets.token_hex(4)}"
  got = _json_out(f"open('/tmp/{mine}', 'w').write('x')\n"
                  f"print(json.dumps([os.path.exists({ctx['host_tmp_file']!r}), os.path.exists('/tmp/{mine}')]))")
  assert got == [False, True], got
  assert not os.path.exists(f"/tmp/{mine}")


def check_system_dirs_read_only(ctx):
  got = _json_out("""out = [len(open('/etc/passwd').read()) > 0]
for path in ('/usr/rljax_probe', '/etc/rljax_probe'):
  try:
    open(path, 'w')
    out.append('written')
  except OSError as e:
    out.append(e.errno)
print(json.dumps(out))""")
  assert got[0] is True and "written" not in got[1:], got
  assert not os.path.exists("/usr/rljax_probe") and not os.path.exists("/etc/rljax_probe")


def check_daemon_dies_with_run(ctx):
  # A double-forked, setsid'd process is gone once run_python returns.
  comm = f"rjd{secrets.token_hex(4)}"
  res = _run(_NAME.format(comm=comm) + """import os, time
if os.fork() == 0:
  os.setsid()
  if os.fork() == 0:
    time.sleep(300)
  os._exit(0)
print("detached")""")
  assert res.ok and "detached" in res.stdout, res.stderr[-500:]
  _none_left(comm)


def check_fork_bomb_contained(ctx):
  comm = f"rjb{secrets.token_hex(4)}"
  start = time.monotonic()
  res = _run(_NAME.format(comm=comm) + """import os
while True:
  try:
    if os.fork() == 0:
      os.setsid()
  except OSError:
    pass""", sandbox.SandboxLimits(timeout_s=1.0))
  assert res.timed_out and time.monotonic() - start < 1.0 + 4.0
  _none_left(comm)


def check_cannot_signal_the_caller(ctx):
  # kill(-1) reaches only the run's own processes: the caller's other children survive.
  res = _run("import os, signal\ntry:\n  os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n  pass\n"
             "print('survived')")
  assert res.ok and "survived" in res.stdout
  assert ctx["sentinel"].poll() is None, "kill(-1) in the sandbox killed a process of the caller"


def check_identity(ctx):
  # As root: a private uid; without root: the user's uid, mapped in its own user namespace,
  # with no capabilities after exec.
  got = _json_out("caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
                  "print(json.dumps([os.getuid(), caps[0] if caps else None]))")
  uid, caps = got
  if os.geteuid() == 0:
    assert sandbox.UID_BASE <= uid < sandbox.UID_BASE + sandbox.UID_SPAN, uid
  else:
    assert uid == os.getuid(), uid
  assert caps in (None, "0000000000000000"), caps


def check_resource_limits(ctx):
  res = _run("blob = bytearray(2 * 2**30)", sandbox.SandboxLimits(timeout_s=3.0, memory_mb=256))
  assert not res.ok and "MemoryError" in res.stderr
  res = _run("print('y' * 10000)", sandbox.SandboxLimits(max_output_bytes=100))
  assert res.ok and res.truncated and len(res.stdout) == 100


def check_disk_quota(ctx):
  # Everything the code can write (its directory, /tmp, /dev/shm) is one tmpfs of disk_mb: 200 MB
  # of writes stop at 16 MB (ENOSPC), never on the host's disk.
  got = _json_out("""written, errors = 0, []
for where in ('.', '/tmp', '/dev/shm'):
  try:
    for i in range(25):
      with open(f'{where}/blob{i}', 'wb') as f:
        for _ in range(8):
          f.write(b'x' * (1 << 20))
          written += 1
  except OSError as e:
    errors.append(e.errno)
print(json.dumps([written, errors]))""", sandbox.SandboxLimits(timeout_s=5.0, disk_mb=16))
  written, errors = got
  assert written <= 16 and errors == [28, 28, 28], got


def _staged(tag: str) -> list[str]:
  return glob.glob(os.path.join(tempfile.gettempdir(), f"rljax-sbx-{tag}-*"))


def check_cleanup_despite_modes(ctx):
  # Directories and files the code made unreadable (chmod 000, its own directory included) do
  # not stop the cleanup: nothing of the run is left on the host.
  tag = f"chk{secrets.token_hex(4)}"
  sandbox.set_worker_tag(tag)
  try:
    res = _run("import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d/e', 0)\n"
               "os.chmod('d', 0)\nos.chmod('.', 0)\nprint('locked')")
  finally:
    sandbox.set_worker_tag(None)
  assert res.ok and "locked" in res.stdout, res.stderr[-500:]
  assert not _staged(tag), _staged(tag)


def check_remove_tree_unlocks(ctx):
  # Without namespaces the code writes into a host directory as this user: the cleanup restores
  # the modes it needs (as root they do not matter; as an ordinary user they do).
  top = tempfile.mkdtemp(prefix="rljax-locked-")
  os.makedirs(os.path.join(top, "a", "b"))
  with open(os.path.join(top, "a", "b", "f"), "w") as f:
    f.write("x")
  for path in (os.path.join(top, "a", "b"), os.path.join(top, "a"), top):
    os.chmod(path, 0)
  sandbox.remove_tree(top)
  assert not os.path.lexists(top)


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


class _Context:
  """What the checks need from the caller: a private file, a listener, a host /tmp file and a
  sentinel child process."""

  def __enter__(self) -> dict:
    self.home = tempfile.mkdtemp(prefix="rljax-home-")
    os.chmod(self.home, 0o700)
    secret = os.path.join(self.home, "secret.txt")
    with open(secret, "w") as f:
      f.write("5")
    os.chmod(secret, 0o600)
    self.listener = socket.create_server(("127.0.0.1", 0))
    fd, self.host_tmp_file = tempfile.mkstemp(prefix="rljax-host-", dir="/tmp")
    os.close(fd)
    self.sentinel = subprocess.Popen(["sleep", "60"])
    return {"home": self.home, "secret": secret, "port": self.listener.getsockname()[1],
            "host_tmp_file": self.host_tmp_file, "sentinel": self.sentinel}

  def __exit__(self, *exc) -> None:
    self.sentinel.kill()
    self.sentinel.wait()
    self.listener.close()
    os.unlink(self.host_tmp_file)
    shutil.rmtree(self.home, ignore_errors=True)


def run_checks(names: list[str]) -> dict[str, str]:
  """Every check (for the unprivileged subprocess): name -> 'ok' or the failure; 'isolation'
  -> sandbox.describe()."""
  results: dict[str, str] = {"isolation": json.dumps(sandbox.describe())}
  with _Context() as ctx:
    for name in names:
      try:
        CHECKS[name](ctx)
        results[name] = "ok"
      except Exception as e:  # noqa: BLE001 - reported to the test
        results[name] = f"{type(e).__name__}: {e}"
  return results


# ---- in-process (root in CI) --------------------------------------------------------------


@pytest.fixture(scope="module")
def ctx():
  iso = sandbox.isolation()
  if not iso.isolated:
    pytest.skip(f"the sandbox cannot isolate here: {iso.note}")
  with _Context() as c:
    yield c


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_sandbox_in_process(ctx, name):
  assert sandbox.isolation().namespaces, sandbox.describe()
  CHECKS[name](ctx)


# ---- as an unprivileged user -----------------------------------------------------------------


def test_sandbox_as_unprivileged_user():
  home = nobody_dir()
  try:
    env = unprivileged_env(home)
    python, why = unprivileged_python(env)
    if python is None:
      print(f"skipped: {why}")
      pytest.skip(why)
    code = f"import json, test_sandbox as t\nprint('RESULTS', json.dumps(t.run_checks({sorted(CHECKS)!r})))\n"
    proc = subprocess.run([python, "-c", code], env=env, user=NOBODY, group=NOBODY, extra_groups=[], cwd=home,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    results = json.loads(lines[-1].split(" ", 1)[1])
    iso = json.loads(results.pop("isolation"))
    if not iso["isolated"]:
      why = f"this kernel forbids unprivileged user namespaces: {iso['note']}"
      print(f"skipped: {why}")
      pytest.skip(why)
    assert iso["user_namespace"] and not iso["uid_switch"], iso
    assert results == {n: "ok" for n in CHECKS}, results
  finally:
    shutil.rmtree(home, ignore_errors=True)


# ---- where no isolation is possible -------------------------------------------------------------


def _unisolated(monkeypatch) -> None:
  """Makes this process's sandbox probe find nothing (as on a kernel without namespaces)."""
  monkeypatch.setattr(sandbox, "_isolation", None)
  monkeypatch.setattr(sandbox, "_probe_run", lambda *a, **k: False)


def test_unisolated_sandbox_warns_once_at_start_up(monkeypatch, caplog):
  _unisolated(monkeypatch)
  spec = RewardSpec.from_dict({"components": [{"name": "code", "verifier": "code"}], "num_workers": 0})
  with caplog.at_level(logging.WARNING, logger="rljax.rewards"):
    RewardPool(spec).close()
    RewardPool(spec).close()
    sandbox.isolation()
  loud = [r for r in caplog.records if "SANDBOX NOT ISOLATED" in r.getMessage()]
  assert len(loud) == 1 and not sandbox.isolation().isolated


def test_require_isolation_refuses_an_unisolated_sandbox(monkeypatch):
  _unisolated(monkeypatch)
  spec = RewardSpec.from_dict({"components": [{"name": "code", "verifier": "code"}], "num_workers": 0,
                               "sandbox": {"require_isolation": True}})
  with pytest.raises(ConfigError, match="require_isolation"):
    RewardPool(spec)
  # Pools without sandboxed verifiers are not affected.
  RewardPool(RewardSpec.from_dict({"components": [{"name": "f", "verifier": "format"}], "num_workers": 0,
                                   "sandbox": {"require_isolation": True}})).close()


def test_require_isolation_passes_where_isolated():
  if not sandbox.isolation().isolated:
    pytest.skip(f"the sandbox cannot isolate here: {sandbox.isolation().note}")
  spec = RewardSpec.from_dict({"components": [{"name": "code", "verifier": "code"}], "num_workers": 0,
                               "sandbox": {"require_isolation": True}})
  with RewardPool(spec) as pool:
    out = pool.score(["```python\nprint(5)\n```"], [{"tests": [{"input": "", "output": "5"}]}])
  assert out.rewards.tolist() == [1.0]


def test_sandbox_option_is_validated():
  with pytest.raises(ConfigError, match="rewards.sandbox"):
    RewardSpec.from_dict({"components": [{"name": "f", "verifier": "format"}], "sandbox": {"isolate": True}})
  with pytest.raises(ConfigError, match="require_isolation must be a bool"):
    RewardSpec.from_dict({"components": [{"name": "f", "verifier": "format"}],
                          "sandbox": {"require_isolation": "yes"}})


def test_docs_table_names_every_check():
  # docs/rewards.md's tables are what these tests check: every row's test exists, every case has a row.
  with open(os.path.join(PROJECT, "docs", "rewards.md")) as f:
    doc = f.read()
  for prefix, cases in (("sandbox", CHECKS), ("hostile", HOSTILE_CASES)):
    named = set(re.findall(prefix + r"\[(\w+)\]", doc))
    assert named <= set(cases), f"docs name {prefix} cases that do not exist: {named - set(cases)}"
    missing = set(cases) - named - {"stderr_flood"}  # named by its own test
    assert not missing, f"{prefix} cases without a row in docs/rewards.md: {missing}"
