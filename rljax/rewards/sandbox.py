"""Running untrusted Python code in a subprocess sandbox (no cgroups, no containers).

Each run gets a fresh temp dir (its cwd, HOME and TMPDIR) and a fresh Python
interpreter started with -I -S -B, with:
  * resource limits: CPU time, address space, processes, file size, open files, no core;
  * its own session (process group), SIGKILLed as a whole on timeout;
  * when running as root: a private, unused uid/gid (different per worker) with no
    supplementary groups, so it cannot read files that are not world-readable, cannot
    signal other processes, and RLIMIT_NPROC caps its processes; after the run every
    process of that uid is killed (kill(-1) as that uid), which also catches
    descendants that left the process group;
  * when running as root: an empty network namespace (no network, loopback down);
  * no_new_privs (setuid binaries cannot raise privileges) and SIGKILL on parent death;
  * stdout/stderr written to files capped by RLIMIT_FSIZE and read back truncated.

Not isolated: world-readable files (system libraries, /etc, ...) can be read; /tmp and
other world-writable places can be written (bounded per file by RLIMIT_FSIZE); CPU and
memory bandwidth are shared; without root there is no uid switch and no network
namespace (the code runs as the calling user with the rlimits only, and RLIMIT_NPROC
counts all of that user's processes, so the code can usually not fork at all).
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

log = logging.getLogger("rljax.rewards")

_PR_SET_CHILD_SUBREAPER = 36
# Private uids: far above any real account, one per worker (or per inline run).
UID_BASE = 0x2F000000
UID_SPAN = 0x00F00000

_libc = None


def _get_libc():
  global _libc
  if _libc is None:
    _libc = ctypes.CDLL(None, use_errno=True)
  return _libc


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one sandboxed run."""
  timeout_s: float = 2.0          # wall clock; RLIMIT_CPU is ceil(timeout_s) + 1
  memory_mb: int = 512            # RLIMIT_AS
  max_processes: int = 16         # RLIMIT_NPROC (enforced for the private uid; see module doc)
  file_size_mb: int = 16          # RLIMIT_FSIZE: largest file (and stdout/stderr) the code can write
  open_files: int = 64            # RLIMIT_NOFILE
  max_output_bytes: int = 1 << 16  # stdout/stderr kept per stream
  network: bool = False           # True: keep the host network (skip the network namespace)


@dataclasses.dataclass
class SandboxResult:
  """What a sandboxed run did."""
  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool
  duration_s: float
  truncated: bool = False
  stdout_tail: str = ""  # the last 4 KiB of stdout, even when `stdout` was truncated

  @property
  def ok(self) -> bool:
    return self.returncode == 0 and not self.timed_out

  @property
  def signal(self) -> int | None:
    return -self.returncode if self.returncode is not None and self.returncode < 0 else None


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What this machine lets the sandbox do (probed once per process)."""
  python: str
  uid_switch: bool
  network_namespace: bool
  note: str = ""


_isolation: Isolation | None = None
_isolation_lock = threading.Lock()
_reap_orphans = False
_WORKER_UID: int | None = None


def allocate_uid() -> int:
  """A random private uid (the chance that two live runs share one is negligible)."""
  return UID_BASE + secrets.randbelow(UID_SPAN)


def set_worker_uid(uid: int | None) -> None:
  """Makes every sandbox run of this process use `uid` (set by pool workers)."""
  global _WORKER_UID
  _WORKER_UID = uid


def become_subreaper() -> bool:
  """Orphaned sandbox processes are re-parented to this process, which reaps them.

  Only for processes that own every child they have (pool workers): reaping with
  waitpid(-1) would steal other code's children.
  """
  global _reap_orphans
  try:
    ok = _get_libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
  except (OSError, AttributeError):
    ok = False
  _reap_orphans = ok
  return ok


# The confinement steps, as source: run in-process between fork and exec (preexec_fn) when
# the caller is single-threaded (pool workers), or by a launcher interpreter that then execs
# the sandboxed one when the caller has threads (e.g. a JAX process), where running Python
# between fork and exec is unsafe.
_CONFINE_SRC = """
import ctypes, os, resource

def confine(uid, rlimits, netns):
  libc = ctypes.CDLL(None, use_errno=True)
  if netns and libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
  for name, soft, hard in rlimits:
    which = getattr(resource, name)
    try:
      resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
      cap = resource.getrlimit(which)[1]
      if cap != resource.RLIM_INFINITY:
        resource.setrlimit(which, (min(soft, cap), min(hard, cap)))
  if uid is not None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
  libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG = SIGKILL (set after the uid change, which clears it)
"""
_LAUNCHER_SRC = _CONFINE_SRC + """
import json, sys
spec = json.loads(sys.argv[1])
confine(spec["uid"], spec["rlimits"], spec["netns"])
os.execv(spec["argv"][0], spec["argv"])
"""
_confine_ns: dict[str, Any] = {}
exec(compile(_CONFINE_SRC, "<rljax sandbox confine>", "exec"), _confine_ns)  # noqa: S102 - our own constant
confine = _confine_ns["confine"]


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
  cpu = int(math.ceil(limits.timeout_s)) + 1
  return [("RLIMIT_CORE", 0, 0), ("RLIMIT_CPU", cpu, cpu + 1),
          ("RLIMIT_AS", int(limits.memory_mb) << 20, int(limits.memory_mb) << 20),
          ("RLIMIT_FSIZE", int(limits.file_size_mb) << 20, int(limits.file_size_mb) << 20),
          ("RLIMIT_NOFILE", int(limits.open_files), int(limits.open_files)),
          ("RLIMIT_NPROC", int(limits.max_processes), int(limits.max_processes))]


def _single_threaded() -> bool:
  """Whether this process has one OS thread (native threads included, unlike threading)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Threads:"):
          return int(line.split()[1]) == 1
  except OSError:
    pass
  return threading.active_count() == 1


def _popen(argv: list[str], uid: int | None, limits: SandboxLimits, netns: bool, **kwargs) -> subprocess.Popen:
  """Starts `argv` confined (see _CONFINE_SRC) in a new session."""
  rlimits = _rlimits(limits)
  if _single_threaded():
    return subprocess.Popen(argv, start_new_session=True, close_fds=True,
                            preexec_fn=lambda: confine(uid, rlimits, netns), **kwargs)
  spec = json.dumps({"uid": uid, "rlimits": rlimits, "netns": netns, "argv": argv})
  return subprocess.Popen([argv[0], "-I", "-S", "-B", "-c", _LAUNCHER_SRC, spec], start_new_session=True,
                          close_fds=True, **kwargs)


def _env(home: str) -> dict[str, str]:
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
          "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0",
          "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _python_candidates() -> list[str]:
  seen, out = set(), []
  env = os.environ.get("RLJAX_SANDBOX_PYTHON")
  for cand in [env, os.path.realpath(sys.executable), getattr(sys, "_base_executable", None),
               shutil.which("python3"), "/usr/bin/python3", "/usr/local/bin/python3"]:
    if cand and os.path.exists(cand):
      real = os.path.realpath(cand)
      if real not in seen:
        seen.add(real)
        out.append(real)
  return out


def _probe_run(python: str, uid: int | None, netns: bool) -> bool:
  limits = SandboxLimits(timeout_s=10.0, memory_mb=1024)
  try:
    proc = _popen([python, "-I", "-S", "-B", "-c", "import os; print(os.getuid())"], uid, limits, netns,
                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                  env=_env("/"))
    out, _ = proc.communicate(timeout=20)
  except (OSError, subprocess.SubprocessError):
    return False
  expected = str(uid if uid is not None else os.getuid())
  return proc.returncode == 0 and out.decode(errors="replace").strip() == expected


def isolation() -> Isolation:
  """Probes (once) which interpreter to use and whether uid switching and network
  namespaces work here."""
  global _isolation
  with _isolation_lock:
    if _isolation is not None:
      return _isolation
    candidates = _python_candidates()
    result = None
    if os.geteuid() == 0:
      uid = allocate_uid()
      for netns in (True, False):
        for py in candidates:
          if _probe_run(py, uid, netns):
            result = Isolation(py, True, netns)
            break
        if result:
          break
      if result is None:
        result = Isolation(candidates[0], False, False,
                           "no interpreter runs as an unprivileged uid (set RLJAX_SANDBOX_PYTHON to one in a "
                           "world-readable location); sandboxed code runs as root with rlimits only")
        log.warning("sandbox: %s", result.note)
      elif not result.network_namespace:
        result = dataclasses.replace(result, note="unshare(CLONE_NEWNET) failed; sandboxed code has network")
        log.warning("sandbox: %s", result.note)
    else:
      result = Isolation(candidates[0], False, False,
                         "not root: no uid switch and no network namespace; rlimits and process-group kill only")
    _isolation = result
    return result


def kill_uid(uid: int | None) -> None:
  """SIGKILLs every process running as `uid` (from a child that takes on that uid).

  kill(-1) runs under the kernel's task-list lock, so processes that are forking cannot
  escape one sweep; two sweeps are done for good measure.
  """
  if uid is None or os.geteuid() != 0:
    return
  if _single_threaded():
    pid = os.fork()
    if pid == 0:  # child: only syscalls, then _exit
      try:
        os.setresuid(uid, uid, uid)
        for _ in range(2):
          try:
            os.kill(-1, signal.SIGKILL)
          except OSError:
            break
      finally:
        os._exit(0)
    os.waitpid(pid, 0)
    return
  # Threads exist (e.g. inside a JAX process): fork+exec instead of a bare fork.
  code = "import os\nfor _ in range(2):\n  try: os.kill(-1, 9)\n  except OSError: break\n"
  try:
    subprocess.run([isolation().python, "-I", "-S", "-c", code], user=uid, group=uid, extra_groups=[],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
  except (OSError, subprocess.SubprocessError) as e:
    log.warning("sandbox: could not kill the processes of uid %d: %s", uid, e)


def remove_dirs_of(pid: int) -> None:
  """Removes the sandbox dirs left by process `pid` (a worker killed in the middle of a run)."""
  for path in glob.glob(os.path.join(tempfile.gettempdir(), f"rljax-sbx-{pid}-*")):
    shutil.rmtree(path, ignore_errors=True)


def reap_orphans(wait_s: float = 0.2) -> None:
  """Reaps re-parented orphans (pool workers are subreapers) until none are left or `wait_s` passes."""
  if not _reap_orphans:
    return
  deadline = time.monotonic() + wait_s
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      if time.monotonic() > deadline:
        return
      time.sleep(0.002)


def _read_capped(f, cap: int) -> tuple[str, bool]:
  f.seek(0)
  data = f.read(cap + 1)
  return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _read_tail(f, size: int = 4096) -> str:
  end = f.seek(0, os.SEEK_END)
  f.seek(max(0, end - size))
  return f.read(size).decode("utf-8", errors="replace")


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None, *,
               files: dict[str, str] | None = None) -> SandboxResult:
  """Runs `source` as the main module of a sandboxed interpreter (see the module doc).

  Args:
    source: Python source code.
    stdin: text fed to the program's stdin.
    limits: SandboxLimits (defaults apply when None).
    files: extra files (name -> text) written into the program's directory.
  Returns:
    SandboxResult; a program killed by a signal has returncode -signum.
  """
  limits = limits or SandboxLimits()
  iso = isolation()
  uid = None
  if iso.uid_switch:
    uid = _WORKER_UID if _WORKER_UID is not None else allocate_uid()
  netns = iso.network_namespace and not limits.network
  tmp = tempfile.mkdtemp(prefix=f"rljax-sbx-{os.getpid()}-")
  start = time.monotonic()
  proc = None
  try:
    for name, text in {"main.py": source, **(files or {})}.items():
      path = os.path.join(tmp, os.path.basename(name))
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
      if uid is not None:
        os.chown(path, uid, uid)
    if uid is not None:
      os.chown(tmp, uid, uid)
    os.chmod(tmp, 0o700)
    # stdout/stderr/stdin live outside the program's directory listing: root-owned fds.
    with tempfile.TemporaryFile(dir=tmp) as fin, tempfile.TemporaryFile(dir=tmp) as fout, \
        tempfile.TemporaryFile(dir=tmp) as ferr:
      fin.write(stdin.encode("utf-8", errors="replace"))
      fin.seek(0)
      timed_out = False
      try:
        proc = _popen([iso.python, "-I", "-S", "-B", "main.py"], uid, limits, netns, stdin=fin, stdout=fout,
                      stderr=ferr, cwd=tmp, env=_env(tmp))
        try:
          proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
          timed_out = True
      finally:
        if proc is not None:
          _kill_tree(proc, uid)
      duration = time.monotonic() - start
      out, t1 = _read_capped(fout, limits.max_output_bytes)
      err, t2 = _read_capped(ferr, limits.max_output_bytes)
      tail = _read_tail(fout)
    return SandboxResult(returncode=None if timed_out else proc.returncode, stdout=out, stderr=err,
                         timed_out=timed_out, duration_s=duration, truncated=t1 or t2, stdout_tail=tail)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  kill_uid(uid)
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed processes always exit
    log.warning("sandbox: process %d did not exit after SIGKILL", proc.pid)
  reap_orphans()


def describe() -> dict[str, Any]:
  """Isolation facts for logs and docs."""
  iso = isolation()
  return {"python": iso.python, "uid_switch": iso.uid_switch, "network_namespace": iso.network_namespace,
          "root": os.geteuid() == 0, "note": iso.note}
