"""Running untrusted Python code in a subprocess sandbox (no cgroups, no containers).

Each run gets its own directory (its cwd and HOME) and a fresh Python interpreter started
with -I -S -B, with:
  * resource limits: CPU time, address space, processes, file size, open files, no core;
  * its own session (process group), SIGKILLed as a whole on timeout;
  * namespaces, where the kernel allows them (as root, or without root through an
    unprivileged user namespace): a mount namespace whose root is a fresh tmpfs with only
    the system directories (/usr, /etc, /lib*, /bin, /sbin and the interpreter's prefix)
    bound read-only, a minimal /dev and its own /proc, and one tmpfs of `disk_mb` holding all
    it can write (its directory at /sandbox, a copy of the staged files, /tmp, /dev/shm), gone
    with the mount namespace whatever modes the code set; the user's home, the project tree and
    the host's /tmp are not there at all. A new network
    namespace (no network: 127.0.0.1 included) and a new PID namespace whose init ends the
    run: when it exits, the kernel kills every process left in it, setsid'd daemons too;
  * when running as root: a private, unused uid/gid (different per worker) with no
    supplementary groups, so it cannot read files that are not world-readable, cannot
    signal other processes, and RLIMIT_NPROC caps its processes; after the run every
    process of that uid is killed (kill(-1) as that uid);
  * no_new_privs (setuid binaries cannot raise privileges) and SIGKILL on parent death;
  * stdin/stdout/stderr in memory files (memfd) capped by RLIMIT_FSIZE, read back truncated.

Where no namespace can be created (e.g. a container whose seccomp profile forbids them, or
kernel.unprivileged_userns_clone=0) the sandbox says so once, loudly, and falls back: as
root to the uid switch and a network namespace alone, without root to the rlimits and the
process-group kill only; the code then writes into its staged directory on the host (per-file
limit only), which `remove_tree` deletes whatever modes were set inside. `isolation().isolated`
tells which; RewardSpec's
`sandbox.require_isolation` turns the fallback into an error. docs/rewards.md has the
table of what sandboxed code can and cannot do, with the test that checks each row.
"""
from __future__ import annotations

import ctypes
import dataclasses
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

from rljax.rewards.confine_src import CONFINE_SRC
from rljax.rewards.sandbox_files import memfile, read_capped, read_tail, remove_dirs_of, remove_tree  # noqa: F401

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
  disk_mb: int = 64               # the run's tmpfs (its directory, /tmp and /dev/shm together)
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
  namespaces: bool = False      # mount + PID (+ IPC, UTS) namespaces: private root, whole-tree kill
  user_namespace: bool = False  # the namespaces come from an unprivileged user namespace (not root)

  @property
  def isolated(self) -> bool:
    """Whether model code is cut off from the network and from the user's files (see the module doc)."""
    return self.network_namespace and (self.namespaces or self.uid_switch)


_isolation: Isolation | None = None
_isolation_lock = threading.Lock()
_reap_orphans = False
_WORKER_UID: int | None = None
_WORKER_TAG: str | None = None


def allocate_uid() -> int:
  """A random private uid (the chance that two live runs share one is negligible)."""
  return UID_BASE + secrets.randbelow(UID_SPAN)


def set_worker_uid(uid: int | None) -> None:
  """Makes every sandbox run of this process use `uid` (set by pool workers)."""
  global _WORKER_UID
  _WORKER_UID = uid


def set_worker_tag(tag: str | None) -> None:
  """Names this process's sandbox dirs (a pool worker's; its zygote removes them when it dies)."""
  global _WORKER_TAG
  _WORKER_TAG = tag


def _tag() -> str:
  return _WORKER_TAG or str(os.getpid())


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


# The confinement steps (rljax/rewards/confine_src.py): the same source in-process and in a launcher.
_CONFINE_SRC = CONFINE_SRC
_LAUNCHER_SRC = _CONFINE_SRC + """
import json, sys
plan = json.loads(sys.argv[1])
confine(plan)
os.execv(plan["argv"][0], plan["argv"])
"""
_confine_ns: dict[str, Any] = {}
exec(compile(_CONFINE_SRC, "<rljax sandbox confine>", "exec"), _confine_ns)  # noqa: S102 - our own constant
confine = _confine_ns["confine"]

# Bound read-only into the private root (when present); the interpreter's prefix is added.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_SANDBOX_HOME = "/sandbox"


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
  cpu = int(math.ceil(limits.timeout_s)) + 1
  return [("RLIMIT_CORE", 0, 0), ("RLIMIT_CPU", cpu, cpu + 1),
          ("RLIMIT_AS", int(limits.memory_mb) << 20, int(limits.memory_mb) << 20),
          ("RLIMIT_FSIZE", int(limits.file_size_mb) << 20, int(limits.file_size_mb) << 20),
          ("RLIMIT_NOFILE", int(limits.open_files), int(limits.open_files)),
          ("RLIMIT_NPROC", int(limits.max_processes), int(limits.max_processes))]


def _binds(python: str) -> list[str]:
  """The host directories visible (read-only) in the private root: system dirs and the
  interpreter's install prefix (<prefix>/bin/python3.x)."""
  out = [d for d in _SYSTEM_DIRS if os.path.lexists(d)]
  prefix = os.path.dirname(os.path.dirname(python))
  if prefix not in ("", "/") and not any(prefix == d or prefix.startswith(d + "/") for d in out):
    out.append(prefix)
  return out


def _plan(python: str, uid: int | None, limits: SandboxLimits, *, netns: bool, namespaces: bool,
          userns: bool, work: str = "", root: str = "") -> dict[str, Any]:
  return {"uid": uid, "rlimits": _rlimits(limits), "netns": netns, "namespaces": namespaces, "userns": userns,
          "work": work, "root": root, "binds": _binds(python), "disk_mb": int(limits.disk_mb)}


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


def _popen(argv: list[str], plan: dict[str, Any], **kwargs) -> subprocess.Popen:
  """Starts `argv` confined (see _CONFINE_SRC) in a new session."""
  if _single_threaded():
    return subprocess.Popen(argv, start_new_session=True, close_fds=True, preexec_fn=lambda: confine(plan),
                            **kwargs)
  spec = json.dumps({**plan, "argv": argv})
  return subprocess.Popen([argv[0], "-I", "-S", "-B", "-c", _LAUNCHER_SRC, spec], start_new_session=True,
                          close_fds=True, **kwargs)


def _env(home: str, tmp: str) -> dict[str, str]:
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
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


_PROBE = "import os\nprint(os.getuid(), os.getpid(), os.getcwd())"


def _probe_run(python: str, uid: int | None, netns: bool, namespaces: bool = False) -> bool:
  """Whether `python` runs confined this way here (and, with namespaces, inside them)."""
  limits = SandboxLimits(timeout_s=10.0, memory_mb=1024)
  userns = namespaces and os.geteuid() != 0
  work = tempfile.mkdtemp(prefix=f"rljax-sbx-{os.getpid()}-")
  root = work + ".root"
  try:
    os.mkdir(root, 0o700)
    if uid is not None:
      os.chown(work, uid, uid)
    plan = _plan(python, uid, limits, netns=netns, namespaces=namespaces, userns=userns, work=work, root=root)
    proc = _popen([python, "-I", "-S", "-B", "-c", _PROBE], plan, stdin=subprocess.DEVNULL,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env=_env(work, work))
    try:
      out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      return False
  except (OSError, subprocess.SubprocessError):
    return False
  finally:
    remove_tree(work)
    remove_tree(root)
  expected = [str(uid if uid is not None else os.getuid())]
  if namespaces:
    expected += ["2", _SANDBOX_HOME]
  return proc.returncode == 0 and out.decode(errors="replace").split()[:len(expected)] == expected


def _probe() -> Isolation:
  candidates = _python_candidates()
  first = candidates[0] if candidates else sys.executable
  root = os.geteuid() == 0
  uid = allocate_uid() if root else None
  levels = []  # (uid, netns, namespaces), most isolated first
  if sys.platform.startswith("linux"):
    levels.append((uid, True, True))
  if root:
    levels += [(uid, True, False), (uid, False, False)]
  for level_uid, netns, namespaces in levels:
    for py in candidates:
      if _probe_run(py, level_uid, netns, namespaces):
        return Isolation(py, level_uid is not None, netns, namespaces=namespaces,
                         user_namespace=namespaces and not root)
  if root:
    return Isolation(first, False, False, "no interpreter runs as an unprivileged uid (set RLJAX_SANDBOX_PYTHON "
                     "to one in a world-readable location); sandboxed code runs as root with rlimits only")
  return Isolation(first, False, False, "no user namespace can be created here (check "
                   "/proc/sys/user/max_user_namespaces, kernel.unprivileged_userns_clone, the container's seccomp "
                   "profile or AppArmor's apparmor_restrict_unprivileged_userns): sandboxed code runs as this user "
                   "with rlimits and a process-group kill only; it can read your files, write into the project "
                   "and use the network")


def isolation() -> Isolation:
  """Probes (once per process) which interpreter to use and how far runs can be isolated;
  says so loudly when model code would not be isolated."""
  global _isolation
  with _isolation_lock:
    if _isolation is not None:
      return _isolation
    result = _probe()
    if result.isolated and not result.namespaces:
      result = dataclasses.replace(result, note="no mount/PID namespace: world-readable files and /tmp are "
                                   "shared with the host; the private uid and the network namespace remain")
    elif result.uid_switch and not result.network_namespace:
      result = dataclasses.replace(result, note="unshare(CLONE_NEWNET) failed; sandboxed code has network")
    if not result.isolated:
      log.warning("SANDBOX NOT ISOLATED: %s. Set rewards.sandbox.require_isolation=True to refuse to run "
                  "like this.", result.note)
    elif result.note:
      log.warning("sandbox: %s", result.note)
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
  iso = _isolation
  if iso is None or iso.namespaces:  # the run's PID namespace already took its processes down
    return
  # Threads exist (e.g. inside a JAX process): fork+exec instead of a bare fork.
  code = "import os\nfor _ in range(2):\n  try: os.kill(-1, 9)\n  except OSError: break\n"
  try:
    subprocess.run([iso.python, "-I", "-S", "-c", code], user=uid, group=uid, extra_groups=[],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
  except (OSError, subprocess.SubprocessError) as e:
    log.warning("sandbox: could not kill the processes of uid %d: %s", uid, e)


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
  # With namespaces `stage` only holds the program's files (ours, 0700); the program runs in a
  # copy on its own tmpfs. Without, it is also the program's directory.
  stage = tempfile.mkdtemp(prefix=f"rljax-sbx-{_tag()}-")
  root = stage + ".root"  # the mount point of the private root (empty on the host)
  start = time.monotonic()
  proc = None
  try:
    for name, text in {"main.py": source, **(files or {})}.items():
      path = os.path.join(stage, os.path.basename(name))
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
      if uid is not None and not iso.namespaces:
        os.chown(path, uid, uid)
    if uid is not None and not iso.namespaces:
      os.chown(stage, uid, uid)
    if iso.namespaces:
      os.mkdir(root, 0o700)
      home, scratch = _SANDBOX_HOME, "/tmp"
    else:
      home = scratch = stage
    plan = _plan(iso.python, uid, limits, netns=netns, namespaces=iso.namespaces, userns=iso.user_namespace,
                 work=stage, root=root)
    # stdin/stdout/stderr are memory files (memfd; RLIMIT_FSIZE caps what the program writes).
    with memfile("stdin") as fin, memfile("stdout") as fout, memfile("stderr") as ferr:
      fin.write(stdin.encode("utf-8", errors="replace"))
      fin.seek(0)
      timed_out = False
      try:
        proc = _popen([iso.python, "-I", "-S", "-B", "main.py"], plan, stdin=fin, stdout=fout, stderr=ferr,
                      cwd=stage, env=_env(home, scratch))
        try:
          proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
          timed_out = True
      finally:
        if proc is not None:
          _kill_tree(proc, uid)
      duration = time.monotonic() - start
      out, t1 = read_capped(fout, limits.max_output_bytes)
      err, t2 = read_capped(ferr, limits.max_output_bytes)
      tail = read_tail(fout)
    return SandboxResult(returncode=None if timed_out else proc.returncode, stdout=out, stderr=err,
                         timed_out=timed_out, duration_s=duration, truncated=t1 or t2, stdout_tail=tail)
  finally:
    remove_tree(stage)
    if os.path.isdir(root):
      os.rmdir(root)


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
  """SIGKILLs the run's process group (with namespaces: C, init and the program, so the
  kernel ends the PID namespace) and, as root, every process of its uid."""
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
          "namespaces": iso.namespaces, "user_namespace": iso.user_namespace, "isolated": iso.isolated,
          "root": os.geteuid() == 0, "note": iso.note}
