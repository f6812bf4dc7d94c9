"""Verifier worker processes and the zygote that forks them.

The pool starts one zygote per pool: a fresh interpreter (fork+exec, so it is safe to
start from a multithreaded JAX process) that imports the verifiers, runs their warm-ups
and then forks workers on request. A new worker therefore costs a fork, not an
interpreter start, which keeps replacing crashed or killed workers cheap.

Control protocol (SOCK_SEQPACKET, pickled tuples, parent <-> zygote):
  zygote -> parent  ("ready", pid, address_space_mb) | ("error", message)   once, after start-up
  parent -> zygote  ("spawn", worker_id, uid)  -> ("spawned", worker_id, pid) + the worker's socket fd
                    ("kill", pid, uid)         SIGKILL the worker's process group and uid (no reply)
                    ("exit",)                  kill every worker, then exit
Worker protocol (multiprocessing Connection over a socketpair, parent <-> worker):
  parent -> worker  [(task_id, component_index, completions, examples, num_tokens, step), ...] | None
  worker -> parent  (task_id, "ok", [(score, info), ...], retire) | (task_id, "error", message, retire)
  one reply per task, in order; `retire` asks the parent to replace the worker (after a MemoryError).
"""
from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import resource
import select
import signal
import socket
import sys
import traceback
from typing import Any

from rljax.rewards.base import normalize_result

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
  try:
    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


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


def _worker_main(sock: socket.socket, uid: int | None, setup: dict[str, Any], zygote_pid: int) -> None:
  from multiprocessing.connection import Connection

  from rljax.rewards import sandbox
  os.setsid()  # own process group: killing it also kills helpers the verifier started
  _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != zygote_pid:
    os._exit(0)
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_DFL)
  limit = int(setup["max_memory_mb"]) << 20
  try:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  except (ValueError, OSError):
    pass
  sandbox.set_worker_uid(uid)
  sandbox.become_subreaper()
  components = setup["components"]
  conn = Connection(sock.detach())
  while True:
    try:
      batch = conn.recv()
    except (EOFError, OSError):
      return
    if batch is None:
      return
    for task_id, comp, completions, examples, num_tokens, step in batch:
      verifier, kwargs = components[comp]
      try:
        reply = (task_id, "ok", call_verifier(verifier, kwargs, completions, examples, num_tokens, step), False)
      except MemoryError as e:
        reply = (task_id, "error", describe_exception(e), True)
      except BaseException as e:  # noqa: BLE001 - a verifier's SystemExit is a failure too
        reply = (task_id, "error", describe_exception(e), False)
      try:
        conn.send(reply)
      except (EOFError, OSError, BrokenPipeError):
        return
      except Exception:  # noqa: BLE001 - e.g. an info value that does not pickle
        if reply[1] == "ok":
          reply = (task_id, "ok", [(s, None) for s, _ in reply[2]], False)
        else:
          reply = (task_id, "error", "unpicklable error message", False)
        conn.send(reply)
      if reply[3]:  # retire: exit after a MemoryError, the parent starts a fresh worker
        return


def _kill_worker(pid: int, uid: int | None) -> None:
  from rljax.rewards import sandbox
  for kill in (os.killpg, os.kill):
    try:
      kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  sandbox.kill_uid(uid)
  sandbox.remove_dirs_of(pid)


def _address_space_mb() -> float:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) / 1024
  except (OSError, ValueError):
    pass
  return 0.0


def _reap(workers: dict[int, int | None]) -> None:
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    workers.pop(pid, None)


def _load_setup(path: str) -> dict[str, Any]:
  with open(path, "rb") as f:
    raw = f.read()
  os.unlink(path)
  head = pickle.loads(raw)
  sys.path[:0] = [p for p in head["sys_path"] if p not in sys.path]
  if head.get("main_path"):
    import multiprocessing.spawn
    multiprocessing.spawn.import_main_path(head["main_path"])
  setup = pickle.loads(head["body"])
  for v, _ in setup["components"]:
    for module in v.preload:
      importlib.import_module(module)
  warmed = set()
  for v, _ in setup["components"]:
    if v.warmup is not None and v.warmup not in warmed:
      warmed.add(v.warmup)
      v.warmup()
  return setup


def zygote_main() -> None:
  """Entry point: python -c 'from rljax.rewards.worker import zygote_main; zygote_main()' FD SETUP_PATH."""
  ctl = socket.socket(fileno=int(sys.argv[1]))
  for sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  devnull = os.open(os.devnull, os.O_RDWR)
  os.dup2(devnull, 0)
  os.dup2(devnull, 1)  # verifier prints go nowhere; stderr stays for tracebacks
  try:
    setup = _load_setup(sys.argv[2])
  except BaseException as e:  # noqa: BLE001
    ctl.send(pickle.dumps(("error", describe_exception(e, 2000))))
    return
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of killed workers come here and are reaped
  ctl.send(pickle.dumps(("ready", os.getpid(), _address_space_mb())))
  workers: dict[int, int | None] = {}
  try:
    while True:
      ready, _, _ = select.select([ctl], [], [], 0.5)
      _reap(workers)
      if not ready:
        continue
      try:
        data = ctl.recv(1 << 16)
      except OSError:
        data = b""
      if not data:
        return  # the parent is gone
      msg = pickle.loads(data)
      if msg[0] == "spawn":
        _, worker_id, uid = msg
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
          pid = os.fork()
        except OSError as e:
          a.close()
          b.close()
          ctl.send(pickle.dumps(("spawn_failed", worker_id, str(e))))
          continue
        if pid == 0:
          code = 0
          try:
            ctl.close()
            a.close()
            _worker_main(b, uid, setup, os.getppid())
          except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 1
          finally:
            os._exit(code)
        b.close()
        workers[pid] = uid
        socket.send_fds(ctl, [pickle.dumps(("spawned", worker_id, pid))], [a.fileno()])
        a.close()
      elif msg[0] == "kill":
        _kill_worker(msg[1], msg[2])
      elif msg[0] == "exit":
        return
  finally:
    for pid, uid in list(workers.items()):
      _kill_worker(pid, uid)
    _reap(workers)
