"""Verifier worker processes and the zygote that forks them.

The pool starts one zygote per pool: a fresh interpreter (fork+exec, so it is safe to
start from a multithreaded JAX process) that imports the verifiers, runs their warm-ups
and then forks workers on request. A new worker therefore costs a fork, not an
interpreter start, which keeps replacing crashed or killed workers cheap.

Control protocol (SOCK_SEQPACKET, pickled tuples, parent <-> zygote):
  zygote -> parent  ("ready", pid, address_space_mb) | ("error", message)   once, after start-up
  parent -> zygote  ("spawn", worker_id, uid)  -> ("spawned", worker_id, pid) + the worker's socket fd
                    ("kill", pid, uid)         SIGKILL the worker, its processes and its uid (no reply)
                    ("exit",)                  kill every worker and every process they left, then exit
Worker protocol (frames over a stream socketpair, parent <-> worker; see encode_frame):
  parent -> worker  [(task_id, component_index, completions, examples, num_tokens, step), ...] | None
  worker -> parent  (task_id, "ok", [(score, info), ...], retire) | (task_id, "error", message, retire)
  one reply per task, in order; `retire` asks the parent to replace the worker (after a MemoryError).

What a verifier cannot do to the pool:
  * print: a worker's stdout and stderr are /dev/null (errors come back in replies);
  * leave processes behind: the worker is a subreaper and, after every item, SIGKILLs every
    descendant it has (double-forked, setsid'd ones included: they are re-parented to it);
    the zygote, a subreaper too, kills whatever a dead worker left;
  * reply twice: a forked copy of the worker that returns from the verifier exits without
    sending (only the worker's own pid speaks the protocol).
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
import struct
import sys
import time
import traceback
from typing import Any

from rljax.rewards.base import normalize_result

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_HEADER = struct.Struct("!Q")
MAX_FRAME = 1 << 30       # a longer frame is a corrupted stream
MAX_REPLY = 64 << 20      # replies above this lose their info dicts
_SWEEP_S = 2.0            # time to spend killing a verifier's leftover processes


def _prctl(option: int, value: int) -> bool:
  try:
    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def encode_frame(obj: Any) -> bytes:
  """A frame: the pickled object's length (8 bytes, big-endian), then the pickle."""
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  return _HEADER.pack(len(data)) + data


def split_frames(buf: bytearray, max_size: int = MAX_FRAME) -> tuple[list[bytes], str | None]:
  """Removes every complete frame from the front of `buf`: their payloads, and why the
  stream is corrupt (None while it is not): a header announcing more than max_size bytes."""
  out = []
  while len(buf) >= _HEADER.size:
    (n,) = _HEADER.unpack_from(buf)
    if n > max_size:
      return out, f"a frame of {n} bytes announced"
    end = _HEADER.size + n
    if len(buf) < end:
      break
    out.append(bytes(buf[_HEADER.size:end]))
    del buf[:end]
  return out, None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  chunks, left = [], n
  while left:
    chunk = sock.recv(min(left, 1 << 20))
    if not chunk:
      raise EOFError
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def recv_frame(sock: socket.socket) -> Any:
  """Blocking read of one frame (the worker's side)."""
  (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
  if n > MAX_FRAME:
    raise EOFError(f"frame of {n} bytes announced")
  return pickle.loads(_recv_exact(sock, n))


def _proc_table() -> dict[int, tuple[int, bytes]]:
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
  table = _proc_table() if table is None else table
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


def kill_descendants(budget_s: float = _SWEEP_S) -> int:
  """SIGKILLs and reaps every descendant of this process, which must be a subreaper (so
  that double-forked, setsid'd processes are re-parented to it, not to init); returns how
  many were killed. Costs one waitpid when there are none."""
  me, killed = os.getpid(), 0
  deadline = time.monotonic() + budget_s
  while _reap_any():
    for pid in descendants(me):
      try:
        os.kill(pid, signal.SIGKILL)
        killed += 1
      except (ProcessLookupError, PermissionError):
        pass
    if time.monotonic() > deadline:
      break
    time.sleep(0.001)
  return killed


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


def _encode_reply(reply: tuple) -> bytes:
  """The reply's frame; info dicts are dropped when they do not pickle or are too large."""
  try:
    frame = encode_frame(reply)
    if len(frame) <= MAX_REPLY:
      return frame
  except Exception:  # noqa: BLE001 - e.g. an info value that does not pickle
    pass
  task_id, status, value, retire = reply
  if status == "ok":
    return encode_frame((task_id, "ok", [(s, None) for s, _ in value], retire))
  return encode_frame((task_id, "error", "unpicklable or oversized error message", retire))


def _worker_main(sock: socket.socket, uid: int | None, setup: dict[str, Any], zygote_pid: int) -> None:
  from rljax.rewards import sandbox
  os.setsid()  # own process group: killing it also kills helpers the verifier started
  _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != zygote_pid:
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
  sandbox.set_worker_uid(uid)
  sandbox.become_subreaper()
  components = setup["components"]
  sock.setblocking(True)
  while True:
    try:
      batch = recv_frame(sock)
    except (EOFError, OSError, pickle.UnpicklingError, ValueError):
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
      if os.getpid() != me:  # a fork made by the verifier returned here: it must not reply
        os._exit(0)
      kill_descendants()  # whatever the verifier started ends with its item
      try:
        sock.sendall(_encode_reply(reply))
      except OSError:
        return
      if reply[3]:  # retire: exit after a MemoryError, the parent starts a fresh worker
        return


def _kill_worker(pid: int, uid: int | None, workers: dict[int, int | None]) -> None:
  """SIGKILLs a worker, its process group and its sandbox uid, waits until it is reaped (so
  that its orphans are re-parented here), then kills those too."""
  from rljax.rewards import sandbox
  for kill in (os.killpg, os.kill):
    try:
      kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  sandbox.kill_uid(uid)
  deadline = time.monotonic() + _SWEEP_S
  while pid in workers and time.monotonic() < deadline:
    _reap(workers)
    if pid in workers:
      time.sleep(0.001)
  sandbox.remove_dirs_of(pid)
  _kill_orphans(workers)


def _kill_orphans(workers: dict[int, int | None]) -> None:
  """SIGKILLs every child of this zygote that is not a live worker, with its descendants:
  what dead workers left behind (the zygote is a subreaper, so it inherits them)."""
  me = os.getpid()
  deadline = time.monotonic() + _SWEEP_S
  while True:
    _reap(workers)
    table = _proc_table()
    strays = []
    for pid, (ppid, state) in table.items():
      if ppid == me and pid not in workers and state != b"Z":
        strays += [pid, *descendants(pid, table)]
    if not strays or time.monotonic() > deadline:
      return
    for pid in strays:
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    time.sleep(0.001)


def _address_space_mb() -> float:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) / 1024
  except (OSError, ValueError):
    pass
  return 0.0


def _reap(workers: dict[int, int | None]) -> list[int]:
  """Reaps dead children; returns the workers among them."""
  dead = []
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return dead
    if pid == 0:
      return dead
    if pid in workers:
      del workers[pid]
      dead.append(pid)


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
      if _reap(workers):  # a worker died on its own: what it left behind goes too
        _kill_orphans(workers)
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
        _kill_worker(msg[1], msg[2], workers)
      elif msg[0] == "exit":
        return
  finally:
    for pid, uid in list(workers.items()):
      _kill_worker(pid, uid, workers)
    _kill_orphans(workers)
