"""The zygote: the process that imports the verifiers once and forks the pool's workers.

The pool starts one zygote per pool: a fresh interpreter (fork+exec, so it is safe to start
from a multithreaded JAX process) that imports the verifiers, runs their warm-ups and then
forks workers on request, so a new worker costs a fork, not an interpreter start.

Containment ("pid-namespace", wherever the kernel allows it: as root, or without root through
an unprivileged user namespace):
  * the launched interpreter (L) unshares a PID namespace (plus a user namespace mapping the
    user's uid to itself when not root) and forks the zygote (Z) as that namespace's init.
    When Z dies, the kernel kills every process in the namespace: whatever a verifier started,
    however it detached (setsid, double fork, clone(CLONE_PARENT), a cleared subreaper flag).
    L only waits: it kills Z when the pool's process goes away (the `alive` pipe closes), and
    Z dies with L (PDEATHSIG);
  * each worker has its own PID namespace: Z forks a helper that unshares one and forks its
    init (I, PID 1: it only reaps), which forks the worker (W, PID 2). Killing I ends everything
    the worker's items started, and W's per-item sweep finds every such process
    (rljax/rewards/worker.py). Verifier code cannot see, signal or stop Z or other workers: their
    pids are not in its namespace. In W, os.getpid() is 2 and /proc is the host's. Without root,
    W drops the capabilities the user namespace gave it.
Fallback ("subreaper", where no namespace can be created): Z and the workers are child
subreapers; Z kills what dead workers left. A process that leaves the tree (clone(CLONE_PARENT)
from a worker, a cleared subreaper flag) can escape; docs/rewards.md says so, and the pool
logs it once at start-up.

Control protocol (SOCK_SEQPACKET, JSON objects, pool <-> zygote):
  zygote -> pool  {"op": "ready", "pid", "vm_mb", "containment", "note"} | {"op": "error", "message"}
  pool -> zygote  {"op": "spawn", "wid", "uid", "rss_mb"} -> {"op": "spawned", "wid", "pid"} plus the
                  worker's socket and pidfd | {"op": "spawn_failed", "wid", "error"}
                  {"op": "kill", "pid", "uid"}   kill a worker (pid as the zygote sees it) and clean up
                  {"op": "exit"}                 kill every worker, then exit
"""
from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from rljax.rewards import wire
from rljax.rewards.worker import (
  CONTAINMENT_ENV,
  SWEEP_S,
  descendants,
  describe_exception,
  map_user,
  prctl,
  proc_table,
  unshare,
  worker_main,
)

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_CLONE_NEWUSER, _CLONE_NEWPID = 0x10000000, 0x20000000



def _address_space_mb() -> float:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) / 1024
  except (OSError, ValueError):
    pass
  return 0.0


def _host_pid() -> int:
  """This process's pid as the pool sees it (in a PID namespace, os.getpid() is not)."""
  try:
    return int(os.readlink("/proc/self"))
  except (OSError, ValueError):
    return os.getpid()


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


def _probe_namespace(flags: int, uid: int, gid: int) -> str | None:
  """Whether a child can unshare `flags` and fork an init there (None) or why not."""
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      os.close(r)
      unshare(flags)
      if flags & _CLONE_NEWUSER:
        map_user(uid, gid)
      init = os.fork()
      if init == 0:
        os._exit(0 if os.getpid() == 1 else 1)
      _, status = os.waitpid(init, 0)
      code = 0 if os.waitstatus_to_exitcode(status) == 0 else 2
    except BaseException as e:  # noqa: BLE001
      os.write(w, str(e).encode()[:500])
    finally:
      os._exit(code)
  os.close(w)
  why = os.read(r, 1000).decode(errors="replace")
  os.close(r)
  _, status = os.waitpid(pid, 0)
  if os.waitstatus_to_exitcode(status) == 0:
    return None
  return why or "the init of a new PID namespace did not start"


def _enter_pool_namespace() -> tuple[str, str]:
  """Moves this process's future children into a new PID namespace (see the module doc):
  ("pid-namespace", "") or ("subreaper", why not)."""
  if os.environ.get(CONTAINMENT_ENV) == "subreaper":
    return "subreaper", f"{CONTAINMENT_ENV}=subreaper"
  if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
    return "subreaper", "PID namespaces and pidfds need Linux 5.3+"
  uid, gid = os.getuid(), os.getgid()
  flags = _CLONE_NEWPID | (_CLONE_NEWUSER if os.geteuid() != 0 else 0)
  why = _probe_namespace(flags, uid, gid)
  if why is not None:
    return "subreaper", f"no PID namespace ({why})"
  unshare(flags)
  if flags & _CLONE_NEWUSER:
    map_user(uid, gid)
  return "pid-namespace", ""


def _launcher(zygote: int, alive_fd: int, keep_w: int) -> None:
  """L: waits for Z; kills it when the pool's process is gone (the alive pipe closes)."""
  del keep_w  # held open until L exits: Z sees its read end close then
  try:
    zfd = os.pidfd_open(zygote)
  except OSError:
    zfd = None
  poller = select.poll()
  poller.register(alive_fd, select.POLLIN)
  if zfd is not None:
    poller.register(zfd, select.POLLIN)
  while True:
    try:
      events = dict(poller.poll(500 if zfd is None else -1))
    except InterruptedError:
      continue
    if alive_fd in events:
      try:
        os.kill(zygote, signal.SIGKILL)
      except ProcessLookupError:
        pass
    pid, status = os.waitpid(zygote, 0 if alive_fd in events or zfd in events else os.WNOHANG)
    if pid:
      os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _fork_worker(ctl: socket.socket, spec: dict[str, Any], setup: dict[str, Any], child_sock: socket.socket,
                 parent_sock: socket.socket) -> int:
  """Forks a worker; returns its pid as this zygote sees it (with namespaces: the namespace's init)."""

  def run() -> None:
    code = 0
    try:
      ctl.close()
      parent_sock.close()
      worker_main(child_sock, spec, setup)
    except BaseException:  # noqa: BLE001
      traceback.print_exc()
      code = 1
    finally:
      os._exit(code)

  if spec["containment"] != "pid-namespace":
    pid = os.fork()
    if pid == 0:
      run()
    return pid
  r, w = os.pipe()
  helper = os.fork()
  if helper == 0:  # unshares a PID namespace for the worker, forks its init, reports the init's pid
    code = 1
    try:
      os.close(r)
      unshare(_CLONE_NEWPID)
      init = os.fork()
      if init == 0:
        os.close(w)
        _worker_init(run, [ctl, parent_sock, child_sock])
      os.write(w, str(init).encode())
      code = 0
    finally:
      os._exit(code)
  os.close(w)
  chunks = []
  while chunk := os.read(r, 64):
    chunks.append(chunk)
  os.close(r)
  os.waitpid(helper, 0)
  if not chunks:
    raise OSError("the worker's PID namespace could not be created")
  return int(b"".join(chunks))


def _worker_init(run, socks: list[socket.socket]) -> None:
  """PID 1 of a worker's namespace: forks the worker (PID 2, which runs verifiers as an ordinary
  process: its signals to itself work), reaps whatever is re-parented here and exits with the
  worker, which ends the namespace."""
  code = 1
  try:
    worker = os.fork()
    if worker == 0:
      run()
    for sock in socks:  # the pool sees the worker's end when the worker ends
      sock.close()
    while True:
      try:
        pid, status = os.waitpid(-1, 0)
      except InterruptedError:
        continue
      except ChildProcessError:
        break
      if pid == worker:
        code = os.waitstatus_to_exitcode(status) & 0xFF
        break
  finally:
    os._exit(code)


def _kill_worker(pid: int, info: dict[str, Any], workers: dict[int, dict], containment: str) -> None:
  """SIGKILLs a worker (with its namespace, or its process group and sandbox uid), waits until it
  is reaped, then removes what it left."""
  from rljax.rewards import sandbox
  kills = (os.kill,) if containment == "pid-namespace" else (os.killpg, os.kill)
  for kill in kills:
    try:
      kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  if containment != "pid-namespace":
    sandbox.kill_uid(info["uid"])
  deadline = time.monotonic() + SWEEP_S
  while pid in workers and time.monotonic() < deadline:
    _reap(workers, containment)
    if pid in workers:
      time.sleep(0.001)
  if containment != "pid-namespace":
    _kill_orphans(workers)


def _kill_orphans(workers: dict[int, dict]) -> None:
  """Without namespaces: SIGKILLs every child of this zygote that is not a live worker, with its
  descendants (what dead workers left behind; the zygote is a subreaper, so it inherits them)."""
  me = os.getpid()
  deadline = time.monotonic() + SWEEP_S
  while True:
    _reap(workers, "subreaper")
    table = proc_table()
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


def _reap(workers: dict[int, dict], containment: str) -> bool:
  """Reaps dead children and cleans up after dead workers; whether a worker died."""
  from rljax.rewards import sandbox
  died = False
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return died
    if pid == 0:
      return died
    info = workers.pop(pid, None)
    if info is not None:
      died = True
      sandbox.remove_dirs_of(info["tag"])


def _serve(ctl: socket.socket, setup_path: str, containment: str, note: str, keep_r: int | None) -> None:
  """Z's loop: forks and kills workers on request until the pool says exit or goes away."""
  try:
    setup = _load_setup(setup_path)
  except BaseException as e:  # noqa: BLE001
    ctl.send(wire.encode_control({"op": "error", "message": describe_exception(e, 2000)}))
    return
  if containment != "pid-namespace":
    prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of killed workers come here and are reaped
  host_pid = _host_pid()
  ctl.send(wire.encode_control({"op": "ready", "pid": host_pid, "vm_mb": _address_space_mb(),
                                "containment": containment, "note": note}))
  workers: dict[int, dict] = {}
  spawned = 0
  watch = [ctl] + ([keep_r] if keep_r is not None else [])
  try:
    while True:
      ready, _, _ = select.select(watch, [], [], 0.5)
      if _reap(workers, containment) and containment != "pid-namespace":
        _kill_orphans(workers)  # a worker died on its own: what it left behind goes too
      if keep_r is not None and keep_r in ready:
        return  # L is gone
      if ctl not in ready:
        continue
      try:
        data = ctl.recv(1 << 16)
      except OSError:
        data = b""
      if not data:
        return  # the pool is gone
      msg = wire.decode_control(data)
      if msg["op"] == "spawn":
        spawned += 1
        spec = {"containment": containment, "uid": msg["uid"], "rss_mb": msg["rss_mb"], "zygote": os.getpid(),
                "tag": f"{host_pid}w{msg['wid']}n{spawned}"}
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
          pid = _fork_worker(ctl, spec, setup, b, a)
          pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        except OSError as e:
          a.close()
          b.close()
          ctl.send(wire.encode_control({"op": "spawn_failed", "wid": msg["wid"], "error": str(e)}))
          continue
        b.close()
        workers[pid] = {"uid": msg["uid"], "tag": spec["tag"]}
        fds = [a.fileno()] + ([pidfd] if pidfd is not None else [])
        socket.send_fds(ctl, [wire.encode_control({"op": "spawned", "wid": msg["wid"], "pid": pid})], fds)
        a.close()
        if pidfd is not None:
          os.close(pidfd)
      elif msg["op"] == "kill":
        info = workers.get(msg["pid"])
        if info is not None:
          _kill_worker(msg["pid"], info, workers, containment)
      elif msg["op"] == "exit":
        return
  finally:
    for pid, info in list(workers.items()):
      _kill_worker(pid, info, workers, containment)
    if containment != "pid-namespace":
      _kill_orphans(workers)


def main() -> None:
  """Entry point: python -c "from rljax.rewards.zygote import main; main()" CTL_FD
  SETUP_PATH ALIVE_FD."""
  ctl = socket.socket(fileno=int(sys.argv[1]))
  alive_fd = int(sys.argv[3])
  for sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  devnull = os.open(os.devnull, os.O_RDWR)
  os.dup2(devnull, 0)
  os.dup2(devnull, 1)  # verifier prints go nowhere; stderr stays for tracebacks
  os.close(devnull)
  try:
    containment, note = _enter_pool_namespace()
  except OSError as e:
    containment, note = "subreaper", f"no PID namespace ({e})"
  keep_r = None
  if containment == "pid-namespace":
    keep_r, keep_w = os.pipe()
    zygote = os.fork()
    if zygote:
      os.close(keep_r)
      ctl.close()
      _launcher(zygote, alive_fd, keep_w)
    os.close(keep_w)
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # Z dies with L
    if select.select([keep_r], [], [], 0)[0]:  # L died before PDEATHSIG was set
      os._exit(0)
  os.close(alive_fd)
  _serve(ctl, sys.argv[2], containment, note, keep_r)
