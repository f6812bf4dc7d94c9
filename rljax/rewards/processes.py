"""The reward pool's processes, seen from the parent: the zygote that forks workers, and the
non-blocking framed channel to each worker (rljax/rewards/pool.py schedules items over them;
rljax/rewards/worker.py is the other end)."""
from __future__ import annotations

import os
import pickle
import select
import socket
import subprocess
import sys
import tempfile
from typing import Any

from rljax.errors import ConfigError
from rljax.rewards.base import Verifier
from rljax.rewards.worker import MAX_REPLY, encode_frame, split_frames

_START_TIMEOUT_S = 120.0
_SPAWN_TIMEOUT_S = 30.0
_READ_CHUNK = 1 << 20
_READ_CHUNKS = 8     # per read(): a worker that floods its socket cannot keep `score` reading


class Lost(Exception):
  """A worker's stream ended or is corrupt."""


class Channel:
  """The parent's end of a worker's socket: non-blocking, frames reassembled as bytes come."""

  def __init__(self, fd: int):
    self.sock = socket.socket(fileno=fd)
    self.sock.setblocking(False)
    self.inbox = bytearray()
    self.outbox = bytearray()

  def fileno(self) -> int:
    return self.sock.fileno()

  def queue(self, obj: Any) -> None:
    self.outbox += encode_frame(obj)

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

  def read(self) -> tuple[list[Any], str | None]:
    """The complete replies that arrived, and why the stream ended (None while it is fine)."""
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
      self.inbox += data
    frames, corrupt = split_frames(self.inbox, MAX_REPLY + (1 << 20))
    replies = []
    for frame in frames:
      try:
        replies.append(pickle.loads(frame))
      except Exception as e:  # noqa: BLE001 - whatever a corrupt frame unpickles into
        return replies, f"corrupt frame ({type(e).__name__})"
    return replies, f"corrupt stream: {corrupt}" if corrupt else ended

  def close(self) -> None:
    self.sock.close()


class Zygote:
  """The process that forks workers (see rljax/rewards/worker.py)."""

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
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
      env[key] = "1"
    try:
      self.proc = subprocess.Popen(
          [sys.executable, "-c", "from rljax.rewards.worker import zygote_main; zygote_main()",
           str(child_sock.fileno()), path],
          pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
      child_sock.close()
    self.sock = parent_sock
    try:
      msg = self._recv(_START_TIMEOUT_S, what="start")
    except BaseException:
      self.proc.kill()
      self.proc.wait()
      self.sock.close()
      raise
    finally:
      if os.path.exists(path):  # the zygote deletes it once read
        os.unlink(path)
    if msg[0] != "ready":
      self.close()
      raise ConfigError(f"the verifier worker process failed to start: {msg[1]}")
    self.address_space_mb = float(msg[2])
    if self.address_space_mb + 256 > max_memory_mb:
      self.close()
      raise ConfigError(f"rewards.max_memory_mb={max_memory_mb} is too small: a worker already maps "
                        f"{self.address_space_mb:.0f} MB after importing its verifiers; raise it to at least "
                        f"{int(self.address_space_mb) + 512}.")

  def _recv(self, timeout: float, what: str) -> tuple[Any, ...]:
    self.sock.settimeout(timeout)
    try:
      data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
    except socket.timeout:
      raise RuntimeError(f"verifier zygote did not answer '{what}' within {timeout:.0f}s") from None
    if not data:
      raise RuntimeError("verifier zygote exited")
    msg = pickle.loads(data)
    return (*msg, fds)

  def spawn(self, wid: int, uid: int | None) -> tuple[int, Channel]:
    self.sock.settimeout(_SPAWN_TIMEOUT_S)
    self.sock.send(pickle.dumps(("spawn", wid, uid)))
    while True:
      msg = self._recv(_SPAWN_TIMEOUT_S, what="spawn")
      if msg[0] == "spawned" and msg[1] == wid and msg[3]:
        for fd in msg[3][1:]:
          os.close(fd)
        return msg[2], Channel(msg[3][0])
      for fd in msg[-1]:
        os.close(fd)
      if msg[0] == "spawn_failed":
        raise RuntimeError(f"fork of a verifier worker failed: {msg[2]}")

  def kill(self, pid: int, uid: int | None) -> None:
    try:
      self.sock.send(pickle.dumps(("kill", pid, uid)))
    except OSError:
      pass

  def alive(self) -> bool:
    """Whether the zygote runs. Its socket end closes before its children get their
    PDEATHSIG, so a worker that died with the zygote always finds it dead here."""
    if self.proc.poll() is not None:
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

  def close(self) -> None:
    try:
      self.sock.settimeout(5)
      self.sock.send(pickle.dumps(("exit",)))
    except OSError:
      pass
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    self.sock.close()
