"""The reward pool's processes, seen from the pool: the supervised zygote that forks workers,
each worker's handle (a pidfd where the kernel has them) and its non-blocking framed channel
(rljax/rewards/pool.py and schedule.py use them; zygote.py and worker.py are the other end)."""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from rljax.errors import ConfigError
from rljax.rewards import wire
from rljax.rewards.base import Verifier

_START_TIMEOUT_S = 120.0   # imports and warm-ups of the verifiers
_SPAWN_TIMEOUT_S = 10.0    # a fork: a zygote that takes longer is replaced
_CLOSE_TIMEOUT_S = 5.0
_POLL_S = 0.25             # how often a wait on the zygote checks that it still runs
_READ_CHUNK = 1 << 20
_READ_CHUNKS = 8           # per read(): a worker that floods its socket cannot keep `score` reading


class Lost(Exception):
  """A worker's stream ended or is corrupt."""


class ZygoteLost(RuntimeError):
  """The zygote is dead, stopped or does not answer."""


def process_state(pid: int) -> str:
  """'running', 'stopped' (SIGSTOP, traced) or 'dead' (exited, zombie, gone)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
  except OSError:
    return "dead"
  state = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3]
  return {b"T": "stopped", b"t": "stopped", b"Z": "dead", b"X": "dead", b"x": "dead"}.get(state, "running")


def pidfd_host_pid(pidfd: int) -> int | None:
  """The pid (in this process's namespace) of the process a pidfd refers to."""
  try:
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
      for line in f:
        if line.startswith("Pid:"):
          return int(line.split()[1])
  except (OSError, ValueError):
    pass
  return None


class Channel:
  """The pool's end of a worker's socket: non-blocking; frames reassembled as bytes come and
  decoded within a time budget (wire.Inbox)."""

  def __init__(self, fd: int):
    self.sock = socket.socket(fileno=fd)
    self.sock.setblocking(False)
    self.inbox = wire.Inbox()
    self.outbox = bytearray()

  def fileno(self) -> int:
    return self.sock.fileno()

  def queue(self, obj: Any) -> None:
    self.outbox += wire.encode_request(obj)

  def flush(self) -> None:
    """Sends what the socket takes now. Raises Lost when the worker is gone."""
    while self.outbox:
      try:
        sent = self.sock.send(self.outbox)
      except BlockingIOError:
        return
      except OSError as e:
        raise Lost(f"send failed ({type(e).__name__})") from None
      del self.outbox[:sent]

  def hung_up(self) -> bool:
    """Whether an idle worker's socket has something to say: its end (it died) or unasked-for bytes."""
    poller = select.poll()
    poller.register(self.sock, select.POLLIN)
    return bool(poller.poll(0))

  @property
  def pending(self) -> bool:
    """Whether decoded-later frames wait (read() again without polling)."""
    return self.inbox.pending

  def read(self) -> tuple[list[dict], str | None]:
    """The messages that arrived (decoded within wire.DECODE_BUDGET_S), and why the stream ended
    or is corrupt (None while it is fine or frames are still queued)."""
    ended = None
    for _ in range(_READ_CHUNKS):
      try:
        data = self.sock.recv(_READ_CHUNK)
      except BlockingIOError:
        break
      except OSError as e:
        ended = type(e).__name__
        break
      if not data:
        ended = "EOF"
        break
      self.inbox.feed(data)
    messages, corrupt = self.inbox.decode()
    if corrupt:
      return messages, f"corrupt stream: {corrupt}"
    return messages, None if self.inbox.pending else ended

  def close(self) -> None:
    self.sock.close()


class WorkerProc:
  """A worker process: its pid as the zygote sees it, its pid here, a pidfd and its channel."""

  def __init__(self, zygote_pid: int, channel: Channel, pidfd: int | None, containment: str):
    self.zygote_pid = zygote_pid
    self.channel = channel
    self.pidfd = pidfd
    self.containment = containment
    self.pid = (pidfd_host_pid(pidfd) if pidfd is not None else None) or zygote_pid

  def pids(self) -> set[int]:
    """Its pid here and its children's (with namespaces the worker runs under an init)."""
    pids = {self.pid}
    try:
      with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
        pids.update(int(p) for p in f.read().split())
    except (OSError, ValueError):
      pass
    return pids

  def kill(self) -> None:
    """SIGKILL, through the pidfd (no pid reuse, any namespace); without namespaces its process
    group too."""
    if self.pidfd is not None:
      try:
        signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
      except OSError:
        pass
    else:
      try:
        os.kill(self.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    if self.containment != "pid-namespace":
      try:
        os.killpg(self.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass

  def close(self) -> None:
    self.channel.close()
    if self.pidfd is not None:
      os.close(self.pidfd)
      self.pidfd = None


class Zygote:
  """The process that forks workers (rljax/rewards/zygote.py), supervised: `state()` reads the
  kernel's view of it (a stopped zygote is not alive), waits on it check that state, and
  `terminate()` ends it with everything it started."""

  def __init__(self, components: list[tuple[Verifier, dict[str, Any]]], max_memory_mb: int):
    try:
      body = pickle.dumps({"components": components, "max_memory_mb": max_memory_mb})
    except (pickle.PicklingError, AttributeError, TypeError) as e:
      raise ConfigError(f"a verifier or its kwargs cannot be sent to worker processes ({e}); define verifiers "
                        "as module-level functions and use plain-data kwargs.") from None
    main = sys.modules.get("__main__")
    uses_main = any(getattr(v.fn, "__module__", None) == "__main__" for v, _ in components)
    main_path = getattr(main, "__file__", None) if uses_main else None
    if uses_main and not main_path:
      raise ConfigError("a verifier is defined in an interactive __main__; move it to an importable module.")
    fd, path = tempfile.mkstemp(prefix="rljax-pool-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
      pickle.dump({"sys_path": [p for p in sys.path if p], "main_path": main_path, "body": body}, f)
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    alive_r, self._alive_w = os.pipe()  # the zygote's launcher kills it when this closes
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
      env[key] = "1"
    self.pid: int | None = None
    try:
      self.proc = subprocess.Popen(
          [sys.executable, "-c", "from rljax.rewards.zygote import main; main()",
           str(child_sock.fileno()), path, str(alive_r)],
          pass_fds=(child_sock.fileno(), alive_r), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
      child_sock.close()
      os.close(alive_r)
    self.sock = parent_sock
    try:
      msg, _ = self._recv(_START_TIMEOUT_S, what="start")
    except BaseException:
      self.terminate()
      raise
    finally:
      if os.path.exists(path):  # the zygote deletes it once read
        os.unlink(path)
    if msg.get("op") != "ready":
      self.terminate()
      raise ConfigError(f"the verifier worker process failed to start: {msg.get('message', msg)}")
    self.pid = int(msg["pid"])
    self.containment = str(msg["containment"])
    self.note = str(msg.get("note", ""))
    self.address_space_mb = float(msg["vm_mb"])
    if self.address_space_mb + 256 > max_memory_mb:
      self.terminate()
      raise ConfigError(f"rewards.max_memory_mb={max_memory_mb} is too small: a worker already maps "
                        f"{self.address_space_mb:.0f} MB after importing its verifiers; raise it to at least "
                        f"{int(self.address_space_mb) + 512}.")

  def state(self) -> str:
    """'running', 'stopped' or 'dead' (the launcher gone counts as dead)."""
    if self.proc.poll() is not None:
      return "dead"
    return process_state(self.pid) if self.pid is not None else "running"

  def _recv(self, timeout: float, what: str) -> tuple[dict, list[int]]:
    """The next control message and the fds it carries; raises ZygoteLost when the zygote dies,
    stops or does not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
      state = self.state()
      if state != "running":
        raise ZygoteLost(f"verifier zygote is {state} (waiting for '{what}')")
      left = deadline - time.monotonic()
      if left <= 0:
        raise ZygoteLost(f"verifier zygote did not answer '{what}' within {timeout:.0f}s")
      if select.select([self.sock], [], [], min(_POLL_S, left))[0]:
        break
    try:
      data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 2, socket.MSG_DONTWAIT)
    except OSError as e:
      raise ZygoteLost(f"verifier zygote's socket failed ({type(e).__name__})") from None
    if not data:
      for fd in fds:
        os.close(fd)
      raise ZygoteLost("verifier zygote exited")
    try:
      return wire.decode_control(data), fds
    except ValueError:
      for fd in fds:
        os.close(fd)
      raise ZygoteLost("verifier zygote sent a corrupt message") from None

  def _send(self, msg: dict) -> None:
    try:
      self.sock.send(wire.encode_control(msg), socket.MSG_DONTWAIT)
    except OSError as e:
      raise ZygoteLost(f"cannot reach the verifier zygote ({type(e).__name__})") from None

  def spawn(self, wid: int, uid: int | None, rss_mb: float) -> WorkerProc:
    """Forks a worker. Raises ZygoteLost (zygote dead, stopped, silent) or RuntimeError (fork failed)."""
    self._send({"op": "spawn", "wid": wid, "uid": uid, "rss_mb": rss_mb})
    while True:
      msg, fds = self._recv(_SPAWN_TIMEOUT_S, what="spawn")
      if msg.get("op") == "spawned" and msg.get("wid") == wid and fds:
        channel = Channel(fds[0])
        return WorkerProc(int(msg["pid"]), channel, fds[1] if len(fds) > 1 else None, self.containment)
      for fd in fds:
        os.close(fd)
      if msg.get("op") == "spawn_failed":
        raise RuntimeError(f"fork of a verifier worker failed: {msg.get('error')}")

  def kill(self, worker: WorkerProc, uid: int | None) -> None:
    """Asks the zygote to reap a killed worker and clean up after it (no reply; never blocks)."""
    try:
      self._send({"op": "kill", "pid": worker.zygote_pid, "uid": uid})
    except ZygoteLost:
      pass

  def alive(self) -> bool:
    """Whether the zygote runs (stopped counts as not). Its socket end closes before the
    workers die with it, so a worker that died with the zygote always finds it dead here."""
    if self.state() != "running":
      return False
    try:
      poller = select.poll()
      poller.register(self.sock, select.POLLIN)
      if not poller.poll(0):
        return True
      return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
      return True
    except (OSError, ValueError):
      return False

  def terminate(self) -> None:
    """SIGKILLs the zygote (with namespaces the kernel then kills every process the pool started)
    and its launcher. Idempotent."""
    for pid in (self.pid, self.proc.pid):
      if pid is not None and self.proc.poll() is None:
        try:
          os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
    self._release()

  def _release(self) -> None:
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILLed processes exit
      pass
    self.sock.close()
    if self._alive_w is not None:
      os.close(self._alive_w)
      self._alive_w = None

  def close(self) -> None:
    """Asks the zygote to kill its workers and exit; terminates it when it is stopped or slow."""
    if self.state() == "running":
      try:
        self._send({"op": "exit"})
        self.proc.wait(timeout=_CLOSE_TIMEOUT_S)
      except (ZygoteLost, subprocess.TimeoutExpired):
        pass
    self.terminate()
