"""One owner per run directory: an advisory lock that a second `rljax train` meets at once.

`RunLock(out_dir)` holds an exclusive `flock` on `<out_dir>/.rljax.lock` and writes who holds it
(process id, host, command, start time) into the file. The kernel drops a `flock` when its
process dies, however it dies, so a lock left by a killed run is stale by construction: the next
start takes it over (and says so) without anyone deleting a file by hand. A start that finds the
lock held stops with a `RunDirInUse` naming the other process and the ways out.

The lock is re-entrant within a process (the CLI takes it before it touches an earlier run's
outputs, and `Trainer.run` takes it again), and it is released, and its file removed, when the
outermost holder exits. Only the writing process of a multi-process run (process 0) takes it.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import threading

from rljax.errors import RljaxError

log = logging.getLogger(__name__)

LOCK_FILE = ".rljax.lock"

_HELD: dict[str, list] = {}     # realpath of the lock file -> [fd, depth]
_GUARD = threading.Lock()


class RunDirInUse(RljaxError):
  """Another live process holds the run directory's lock."""


def _read_owner(fd: int) -> dict:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    data = json.loads(os.read(fd, 65536).decode("utf-8") or "{}")
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


def _describe(owner: dict) -> str:
  if not owner:
    return "another process (it has not written its details yet)"
  parts = [f"process {owner.get('pid', '?')} on host {owner.get('host', '?')}"]
  if owner.get("command"):
    parts.append(f"running `{owner['command']}`")
  if owner.get("started"):
    parts.append(f"since {owner['started']}")
  return ", ".join(parts)


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ProcessLookupError, ValueError, TypeError):
    return False
  except PermissionError:
    return True
  return True


class RunLock:
  """`with RunLock(out_dir): ...` owns `out_dir` for the block (see the module docstring).

  Raises RunDirInUse on entry when another live process holds it. Creates `out_dir` if needed.
  """

  def __init__(self, out_dir: str):
    self.out_dir = out_dir
    self.path = os.path.join(os.path.abspath(out_dir), LOCK_FILE)

  def __enter__(self) -> "RunLock":
    with _GUARD:
      held = _HELD.get(self.path)
      if held is not None:
        held[1] += 1
        return self
      _HELD[self.path] = [self._acquire(), 1]
    return self

  def __exit__(self, *exc) -> None:
    with _GUARD:
      held = _HELD.get(self.path)
      if held is None:
        return
      held[1] -= 1
      if held[1] > 0:
        return
      del _HELD[self.path]
      fd = held[0]
      try:   # remove the file while still holding the lock, so no one can lock the old inode after us
        os.unlink(self.path)
      except OSError:
        pass
      os.close(fd)

  def _acquire(self) -> int:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        owner = _read_owner(fd)
        os.close(fd)
        raise RunDirInUse(
            f"{self.out_dir} is in use by another run: {_describe(owner)} (lock file {self.path}). Two runs in "
            "one directory would mix their metrics and checkpoints. Wait for it to finish, or stop it "
            f"(`kill -TERM {owner.get('pid', 'PID')}` makes it save a checkpoint and exit), or train in another "
            "directory (--config.output.dir=runs/NEW).") from None
      except OSError as e:   # a filesystem without flock: run unlocked rather than not at all
        log.warning("could not lock %s (%s); two runs in this directory would not be detected.", self.path, e)
        return fd
      # The holder before us may have unlinked the file between our open and our flock: then we hold
      # the lock of a file no one else can see. Retry on the file the path names now.
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if not same:
        os.close(fd)
        continue
      stale = _read_owner(fd)
      if stale.get("pid") and not (stale.get("host") == socket.gethostname() and _pid_alive(stale["pid"])):
        log.info("%s: took over the lock of %s, which is no longer running", self.out_dir, _describe(stale))
      owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(["rljax", *sys.argv[1:]])
               if sys.argv and sys.argv[0].endswith(("rljax", "cli.py")) else shlex.join(sys.argv),
               "started": datetime.datetime.now().isoformat(timespec="seconds")}
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      os.write(fd, json.dumps(owner).encode("utf-8"))
      return fd


def holder(out_dir: str) -> dict | None:
  """Who holds `out_dir`'s lock now ({pid, host, command, started}), or None when no live process
  does. Reads only: a dry run uses it to say whether a real start would meet a running one."""
  path = os.path.join(os.path.abspath(out_dir), LOCK_FILE)
  with _GUARD:
    if path in _HELD:
      return {"pid": os.getpid(), "host": socket.gethostname()}
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except BlockingIOError:
    return _read_owner(fd) or {}
  except OSError:
    return None
  finally:
    os.close(fd)
  return None
