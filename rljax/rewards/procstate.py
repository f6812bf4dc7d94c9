"""A verifier worker's process state, checked after every item (rljax/rewards/worker.py).

An item that changes its worker's process state could break every later item of that worker:
closed or leaked file descriptors, another working directory, a changed environment, threads
left running, an armed interval timer, changed signal dispositions or mask, lowered
RLIMIT_NOFILE/RLIMIT_AS, another uid, gid, umask or priority, replaced sys.std* streams, or
memory that keeps growing. The worker snapshots this state once, before its first item, and
compares after each item; any difference (or resident memory grown past a bound) makes the
worker ask to be replaced by a fresh fork of the zygote after replying. The item itself keeps
its result.

One check is one read of /proc/self/stat plus about 12 cheap system calls; docs/rewards.md has
the measured per-item overhead. Not compared (cost against likelihood): which file an fd names
(a verifier that closes fd 1 and opens a file there keeps the count), POSIX timers
(timer_create), state a C extension keeps below the Python level, and Python-level state
(module globals, caches, monkeypatches): that is the verifier's own, shared by the items of one
worker as in any long-lived process.
"""
from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time
from typing import Callable

# The limits whose lowering breaks later items (EMFILE, MemoryError): one getrlimit each per check.
_RLIMIT_IDS = [(name, getattr(resource, name)) for name in ("RLIMIT_NOFILE", "RLIMIT_AS") if hasattr(resource, name)]
_ITIMERS = (("ITIMER_REAL", signal.ITIMER_REAL), ("ITIMER_VIRTUAL", signal.ITIMER_VIRTUAL),
            ("ITIMER_PROF", signal.ITIMER_PROF))
# Fields of /proc/self/stat, counted from the one after the command name (state = 0).
_THREADS, _RSS, _BLOCKED, _IGNORED, _CAUGHT = 17, 21, 29, 30, 31
_PAGE = os.sysconf("SC_PAGE_SIZE")
# A Python thread's join() returns when the thread releases its state, a moment before the kernel
# drops it from the thread count; on a busy machine that moment can outlast the item's reply. Only
# when every Python thread the item started has been joined is the kernel's count given this long.
_JOINED_THREAD_GRACE_S = 1.0


def _environ() -> dict:
  # os.environ's own dict (compared in C); a plain copy where that private attribute is missing.
  data = getattr(os.environ, "_data", None)
  return data if isinstance(data, dict) else dict(os.environ)


def _signal_names(mask: int) -> str:
  names = []
  for bit in range(64):
    if mask >> bit & 1:
      try:
        names.append(signal.Signals(bit + 1).name)
      except ValueError:
        names.append(f"signal {bit + 1}")
  return ", ".join(names) or "none"


class ProcessState:
  """The baseline of this process's state and the check against it (see the module doc).

  rss_growth_mb: resident memory may grow this much over the baseline before the worker is
    replaced (a slow leak must not end in a MemoryError charged to an innocent item).
  extra: more checks, each returning a difference or None (the worker adds its own).
  """

  def __init__(self, rss_growth_mb: float, extra: Callable[[], str | None] | None = None):
    self.rss_growth = int(rss_growth_mb * (1 << 20))
    self.extra = extra
    self._stat = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
    self._fd_dir = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    self._count_by_size = os.fstat(self._fd_dir).st_size > 0  # Linux 6.2+: st_size = open fds
    self.fd_count = self._fd_count()
    stat = self._stat_fields()
    self.threads = stat[_THREADS]
    self.py_threads = threading.active_count()
    self.signals = stat[_BLOCKED:_CAUGHT + 1]
    self.rss = int(stat[_RSS]) * _PAGE
    self.cwd = self._cwd()
    self.env = dict(_environ())
    self.itimers = [signal.getitimer(which) for _, which in _ITIMERS]
    self.umask = self._umask()
    self.ids = (os.getresuid(), os.getresgid())
    self.rlimits = [resource.getrlimit(which) for _, which in _RLIMIT_IDS]
    self.priority = os.getpriority(os.PRIO_PROCESS, 0)
    self.streams = (sys.stdin, sys.stdout, sys.stderr, sys.getrecursionlimit())

  def _fd_count(self) -> int:
    if self._count_by_size:
      return os.fstat(self._fd_dir).st_size
    return len(os.listdir("/proc/self/fd"))

  def _stat_fields(self) -> list[bytes]:
    raw = os.pread(self._stat, 4096, 0)
    return raw[raw.rindex(b")") + 2:].split()

  @staticmethod
  def _cwd() -> str | None:
    try:
      return os.getcwd()
    except OSError:  # removed
      return None

  @staticmethod
  def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old

  def _after_joined_threads_exit(self, stat: list[bytes]) -> list[bytes]:
    """The stat fields once the kernel has caught up with threads Python already joined.

    Returns at once when Python itself still runs more threads than at the baseline (a thread
    left running), or when the kernel's count is below the baseline."""
    deadline = time.monotonic() + _JOINED_THREAD_GRACE_S
    pause = 0.0005
    while (int(stat[_THREADS]) > int(self.threads) and threading.active_count() <= self.py_threads
           and time.monotonic() < deadline):
      time.sleep(pause)
      pause = min(pause * 2, 0.05)
      stat = self._stat_fields()
    return stat

  def check(self) -> str | None:
    """What differs from the baseline (None: nothing); likeliest first. About 13 system calls."""
    stat = self._stat_fields()
    if stat[_THREADS] != self.threads:
      stat = self._after_joined_threads_exit(stat)
    if stat[_THREADS] != self.threads:
      return f"left {int(stat[_THREADS]) - int(self.threads)} thread(s) running"
    if stat[_BLOCKED:_CAUGHT + 1] != self.signals:
      return self._describe_signals(stat[_BLOCKED:_CAUGHT + 1])
    grown = int(stat[_RSS]) * _PAGE - self.rss
    if grown > self.rss_growth:
      return (f"grew the worker's resident memory by {grown >> 20} MB (a worker is replaced past "
              f"{self.rss_growth >> 20} MB)")
    count = self._fd_count()
    if count != self.fd_count:
      delta = count - self.fd_count
      return (f"left {delta} more file descriptor(s) open" if delta > 0
              else f"closed {-delta} of the worker's file descriptors")
    if self._cwd() != self.cwd:
      return "changed the working directory (or removed it)"
    env = _environ()
    if env != self.env:
      keys = sorted(set(env) ^ set(self.env) | {k for k in self.env if env.get(k) != self.env[k]})
      names = [k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in keys[:5]]
      return f"changed the environment ({', '.join(names)})"
    for (name, which), base in zip(_ITIMERS, self.itimers):
      if signal.getitimer(which) != base:
        return f"left an interval timer armed ({name})"
    if self._umask() != self.umask:
      return "changed the umask"
    if (os.getresuid(), os.getresgid()) != self.ids:
      return "changed its uid or gid"
    for (name, which), base in zip(_RLIMIT_IDS, self.rlimits):
      if resource.getrlimit(which) != base:
        return f"lowered a resource limit ({name})"
    if os.getpriority(os.PRIO_PROCESS, 0) != self.priority:
      return "changed its scheduling priority"
    if (sys.stdin, sys.stdout, sys.stderr, sys.getrecursionlimit()) != self.streams:
      return "replaced sys.stdin/stdout/stderr or changed the recursion limit"
    return self.extra() if self.extra is not None else None

  def _describe_signals(self, now: list[bytes]) -> str:
    parts = []
    for label, old, new in zip(("blocked", "ignored", "handled"), self.signals, now):
      old, new = int(old), int(new)
      if old != new:
        added, removed = new & ~old, old & ~new
        if added:
          parts.append(f"{label}: {_signal_names(added)}")
        if removed:
          parts.append(f"no longer {label}: {_signal_names(removed)}")
    return f"changed signal dispositions ({'; '.join(parts)})"
