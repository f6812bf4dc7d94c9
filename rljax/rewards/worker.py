"""Verifier worker processes: the loop that runs items (forked by rljax/rewards/zygote.py; the
pool's side is rljax/rewards/processes.py).

A worker runs the items the pool sends, one after another, and after each one:
  * ends every process the item started: with PID namespaces the worker (PID 2) shares its
    namespace only with the namespace's init (PID 1, which only reaps), so one kill(-1) ends
    every process the item started, however it detached (`sweep_namespace`); without, the
    worker is a child subreaper and kills the descendants it finds in /proc (`kill_descendants`);
  * compares its process state with the snapshot taken before its first item (procstate.py)
    and, when the item changed anything, says so in its reply and exits: the pool replaces it
    with a fresh fork of the zygote, and the item keeps its result;
  * replies with plain data (wire.encode_reply).
A sys.meta_path hook tells the pool when a verifier starts importing a module the worker does
not have, so that a timeout during such an import says what to preload.

Worker protocol (frames, rljax/rewards/wire.py): pickled request lists
[(task_id, component, completions, examples, num_tokens, step), ...] (None: exit); JSON replies,
one per task, in order. A forked copy of the worker that returns from a verifier exits without
replying (only the worker itself speaks the protocol). Its stdout and stderr are /dev/null.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import platform
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from rljax.rewards import wire
from rljax.rewards.base import normalize_result
from rljax.rewards.procstate import ProcessState

_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_CLONE_NEWUSER, _CLONE_NEWPID = 0x10000000, 0x20000000
_CAPSET = {"x86_64": 126, "aarch64": 91, "riscv64": 91}
SWEEP_S = 2.0            # time to spend killing a verifier's leftover processes
CONTAINMENT_ENV = "RLJAX_POOL_CONTAINMENT"   # "subreaper": skip the namespaces (tests of the fallback)

_libc_handle = None


def _libc():
  global _libc_handle
  if _libc_handle is None:
    _libc_handle = ctypes.CDLL(None, use_errno=True)
  return _libc_handle


def prctl(option: int, value: int) -> bool:
  try:
    return _libc().prctl(option, value, 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def prctl_get(option: int) -> int | None:
  out = ctypes.c_int(-1)
  try:
    return out.value if _libc().prctl(option, ctypes.byref(out), 0, 0, 0) == 0 else None
  except (OSError, AttributeError):
    return None


def unshare(flags: int) -> None:
  if _libc().unshare(flags) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"unshare: {os.strerror(err)}")


def map_user(uid: int, gid: int) -> None:
  """Maps this user namespace's uid/gid to the user's own (no other id exists in it)."""
  for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
      f.write(text)


def drop_capabilities() -> None:
  """Clears the capabilities a process holds in its user namespace (not as root: verifiers run
  with the rights of the trainer's user, like elsewhere)."""
  number = _CAPSET.get(platform.machine())
  if number is None:
    return
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
  _libc().syscall(number, header, data)


# ---- the per-item sweep -----------------------------------------------------------------------


def proc_table() -> dict[int, tuple[int, bytes]]:
  """pid -> (ppid, state) of every process visible in /proc."""
  table = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    fields = stat[stat.rindex(b")") + 2:].split()
    table[int(entry)] = (int(fields[1]), fields[0])
  return table


def descendants(root: int, table: dict[int, tuple[int, bytes]] | None = None) -> list[int]:
  """Live (non-zombie) descendants of `root`."""
  table = proc_table() if table is None else table
  children: dict[int, list[int]] = {}
  for pid, (ppid, _) in table.items():
    children.setdefault(ppid, []).append(pid)
  found, frontier = [], [root]
  while frontier:
    for pid in children.get(frontier.pop(), ()):
      found.append(pid)
      frontier.append(pid)
  return [pid for pid in found if table[pid][1] != b"Z"]


def _reap_any() -> bool:
  """Reaps dead children; whether any child (alive) is left."""
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return False
    if pid == 0:
      return True


def kill_descendants(budget_s: float = SWEEP_S) -> bool:
  """SIGKILLs and reaps every descendant of this process, which must be a subreaper (so that
  double-forked, setsid'd processes are re-parented to it). Whether none is left. Costs one
  waitpid when there are none."""
  me = os.getpid()
  deadline = time.monotonic() + budget_s
  while _reap_any():
    for pid in descendants(me):
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    if time.monotonic() > deadline:
      return False
    time.sleep(0.001)
  return True


def sweep_namespace(budget_s: float = SWEEP_S) -> bool:
  """In a worker's PID namespace (its init is our parent): kills every process in the namespace
  but its init and this one, however it was started (setsid, double fork, clone(CLONE_PARENT),
  adopted by the init), and reaps this process's children. Whether none is left. Costs one
  kill(-1) (about 10 us) when there are none."""
  deadline = time.monotonic() + budget_s
  while True:
    try:
      os.kill(-1, signal.SIGKILL)  # every process in this namespace but its init and the caller
    except ProcessLookupError:
      return True
    except OSError:
      return False
    _reap_any()
    if time.monotonic() > deadline:
      return False
    time.sleep(0.001)


# ---- calling verifiers ------------------------------------------------------------------------


def describe_exception(e: BaseException, limit: int = 400) -> str:
  """'Type: message (at file:line)' of the innermost frame, capped at `limit` characters."""
  where = ""
  tb = traceback.extract_tb(e.__traceback__)
  if tb:
    frame = tb[-1]
    where = f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
  msg = f"{type(e).__name__}: {e}"
  if len(msg) > limit:
    msg = msg[:limit] + "..."
  return msg + where


def call_verifier(verifier, kwargs: dict[str, Any], completions: list[str], examples: list[Any],
                  num_tokens: list[int] | None, step: int) -> list[tuple[float, dict | None]]:
  """Runs one verifier task and normalises its results (raises on a bad result)."""
  extra = dict(kwargs)
  if verifier.wants_step:
    extra["step"] = step
  if verifier.kind == "item":
    if verifier.wants_num_tokens:
      extra["num_tokens"] = None if num_tokens is None else num_tokens[0]
    return [normalize_result(verifier.fn(completions[0], examples[0], **extra))]
  if verifier.wants_num_tokens:
    extra["num_tokens"] = num_tokens
  if verifier.kind == "group":
    out = verifier.fn(list(completions), examples[0], **extra)
  else:
    out = verifier.fn(list(completions), list(examples), **extra)
  out = list(out)
  if len(out) != len(completions):
    raise ValueError(f"{verifier.kind} verifier '{verifier.name}' returned {len(out)} results "
                     f"for {len(completions)} completions")
  return [normalize_result(v) for v in out]


class _ImportWatch:
  """A sys.meta_path finder that tells the pool when a verifier starts importing a module the
  worker does not have yet (a slow import inside a verifier times out in every new worker; the
  pool names it in the timeout's message). It finds nothing itself; modules already imported
  never reach it, so it costs nothing once they are."""

  def __init__(self, sock: socket.socket):
    self.sock = sock
    self.task: int | None = None
    self.seen: set[str] = set()
    self.pid = os.getpid()
    self.thread = threading.get_ident()

  def find_spec(self, name, path=None, target=None):
    task = self.task
    if task is not None and os.getpid() == self.pid and threading.get_ident() == self.thread:
      top = name.partition(".")[0]
      if top not in self.seen:
        self.seen.add(top)
        try:
          self.sock.sendall(wire.encode_note(task, "import", m=top))
        except OSError:
          pass
    return None

  def invalidate_caches(self) -> None:
    pass


# ---- the worker -------------------------------------------------------------------------------


def worker_main(sock: socket.socket, spec: dict[str, Any], setup: dict[str, Any]) -> None:
  from rljax.rewards import sandbox
  namespaced = spec["containment"] == "pid-namespace"
  os.setsid()  # own session: a terminal's signals do not reach it
  if not namespaced:
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["zygote"]:
      os._exit(0)
  me = os.getpid()
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)  # a verifier's prints cannot flood or block the trainer's stderr
  os.close(devnull)
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_DFL)
  limit = int(setup["max_memory_mb"]) << 20
  try:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  except (ValueError, OSError):
    pass
  sandbox.set_worker_uid(spec["uid"])
  sandbox.set_worker_tag(spec["tag"])
  if namespaced:
    if os.geteuid() != 0:
      drop_capabilities()
    sweep, extra = sweep_namespace, None
  else:
    sandbox.become_subreaper()
    sweep, extra = kill_descendants, _fallback_state
  components = setup["components"]
  sock.setblocking(True)
  watch = _ImportWatch(sock)
  sys.meta_path.insert(0, watch)
  state = ProcessState(spec["rss_mb"], extra)
  while True:
    try:
      batch = wire.recv_request(sock)
    except (EOFError, OSError, pickle.UnpicklingError, ValueError):
      return
    if batch is None:
      return
    for task_id, comp, completions, examples, num_tokens, step in batch:
      verifier, kwargs = components[comp]
      results = error = recycle = None
      watch.task = task_id
      try:
        results = call_verifier(verifier, kwargs, completions, examples, num_tokens, step)
      except MemoryError as e:
        error, recycle = describe_exception(e), "raised MemoryError"
      except BaseException as e:  # noqa: BLE001 - a verifier's SystemExit is a failure too
        error = describe_exception(e)
      finally:
        watch.task = None
      if os.getpid() != me:  # a fork made by the verifier returned here: it must not reply
        os._exit(0)
      if not sweep():  # whatever the verifier started ends with its item
        recycle = recycle or "left processes that did not die"
      recycle = recycle or state.check()
      try:
        sock.sendall(wire.encode_reply(task_id, results, error, recycle))
      except OSError:
        return
      if recycle:  # the pool replaces this worker with a fresh fork of the zygote
        return


def _fallback_state() -> str | None:
  """The extra process state a worker relies on without namespaces."""
  if prctl_get(_PR_GET_CHILD_SUBREAPER) not in (None, 1):
    return "cleared the worker's child-subreaper flag"
  if prctl_get(_PR_GET_PDEATHSIG) not in (None, signal.SIGKILL):
    return "changed the worker's parent-death signal"
  return None
