"""RewardPool: scores completions with verifiers in worker processes that cannot hang,
crash or leak into the caller.

    with RewardPool(spec) as pool:
      out = pool.score(completions, examples, num_tokens=lengths, group_size=G, step=step)
      out.rewards, out.components, out.metrics

Guarantees (with num_workers > 0):
  * per-item timeout: a verifier call running past timeout_s (times its number of items
    for group/batch verifiers) is killed with its worker, which is replaced;
  * per-batch deadline: `score` returns within about batch_deadline_s, items left
    unscored get the fallback;
  * crash isolation: a worker that dies (segfault, os._exit, OOM kill) is replaced and
    its item gets the fallback;
  * bounded memory: each worker has RLIMIT_AS = max_memory_mb;
  * no leaks: close() kills the workers, their sandboxed subprocesses and the zygote.
Every failure is counted in the metrics (verifier/timeouts, verifier/errors,
verifier/crashes, verifier/deadline_misses) and the first error messages are logged.

`score` only uses sockets and select (no signals), so it is safe to call from any thread,
including a `jax.experimental.io_callback` inside a jitted step.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import ConfigError
from rljax.rewards import sandbox
from rljax.rewards.base import Verifier
from rljax.rewards.compose import RewardBatch, batch_metrics, combine
from rljax.rewards.spec import RewardSpec
from rljax.rewards.worker import call_verifier, describe_exception

log = logging.getLogger("rljax.rewards")

_MAX_BATCH_ERRORS = 20
_LABELS = {"timeouts": "timeout", "errors": "error", "crashes": "crash", "deadline_misses": "deadline"}
_MAX_CHUNK = 8       # tasks per message to a worker
_REFILL_BELOW = 2    # send a worker more tasks once it has at most this many queued
_START_TIMEOUT_S = 120.0
_SPAWN_TIMEOUT_S = 30.0


@dataclasses.dataclass
class _Task:
  tid: int
  comp: int
  items: list[int]
  timeout: float


@dataclasses.dataclass
class _Worker:
  wid: int
  uid: int | None
  pid: int = 0
  conn: Connection | None = None
  queue: collections.deque = dataclasses.field(default_factory=collections.deque)
  deadline: float = 0.0

  @property
  def alive(self) -> bool:
    return self.conn is not None


class _Zygote:
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

  def spawn(self, wid: int, uid: int | None) -> tuple[int, Connection]:
    self.sock.settimeout(_SPAWN_TIMEOUT_S)
    self.sock.send(pickle.dumps(("spawn", wid, uid)))
    while True:
      msg = self._recv(_SPAWN_TIMEOUT_S, what="spawn")
      if msg[0] == "spawned" and msg[1] == wid and msg[3]:
        return msg[2], Connection(msg[3][0])
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
    return self.proc.poll() is None

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


class RewardPool:
  """Scores completions with the components of a RewardSpec (see the module doc)."""

  def __init__(self, spec: RewardSpec | Mapping[str, Any]):
    if not isinstance(spec, RewardSpec):
      spec = RewardSpec.from_dict(spec)
    spec.validate()
    self.spec = spec
    self.verifiers: list[Verifier] = spec.resolve()
    self.component_names = spec.component_names
    self._lock = threading.RLock()
    self._owner = os.getpid()
    self._zygote: _Zygote | None = None
    self._workers: list[_Worker] = []
    self._next_tid = 0
    self._logged = 0
    self._closed = False
    self.totals: collections.Counter = collections.Counter()
    self._remote_needed = spec.num_workers > 0 and any(not v.inline for v in self.verifiers)
    _LIVE_POOLS.add(self)
    if self._remote_needed:
      try:
        self._zygote = _Zygote(self._remote_components(), spec.max_memory_mb)
        self._workers = [_Worker(wid=i, uid=self._new_uid()) for i in range(spec.num_workers)]
        for w in self._workers:
          self._spawn(w)
      except BaseException:
        self.close()
        raise

  def _remote_components(self) -> list[tuple[Verifier, dict[str, Any]]]:
    return [(v, dict(c.kwargs)) for v, c in zip(self.verifiers, self.spec.components)]

  # ---- lifecycle ---------------------------------------------------------------------------

  def __enter__(self) -> RewardPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass

  def close(self) -> None:
    """Stops every worker, sandboxed subprocess and the zygote. Idempotent."""
    if self._closed:
      return
    self._closed = True
    if os.getpid() != self._owner:  # a forked copy of the owner: the processes are not ours
      return
    with self._lock:
      for w in self._workers:
        if w.alive:
          self._kill(w, reason=None)
      if self._zygote is not None:
        self._zygote.close()
        self._zygote = None

  @staticmethod
  def _new_uid() -> int | None:
    return sandbox.allocate_uid() if os.geteuid() == 0 else None

  def _spawn(self, w: _Worker) -> None:
    assert self._zygote is not None
    try:
      w.pid, w.conn = self._zygote.spawn(w.wid, w.uid)
    except (RuntimeError, OSError) as e:
      if self._zygote.alive():
        raise
      log.warning("verifier zygote died (%s); restarting it", e)
      self._restart_zygote()
      w.pid, w.conn = self._zygote.spawn(w.wid, w.uid)
    w.queue.clear()

  def _restart_zygote(self) -> None:
    old = self._zygote
    if old is not None:
      try:
        old.close()
      except Exception:  # noqa: BLE001
        pass
    self._zygote = _Zygote(self._remote_components(), self.spec.max_memory_mb)
    self.totals["zygote_restarts"] += 1
    # Workers of the old zygote die with it (PDEATHSIG); their items are reported as crashes.

  def _kill(self, w: _Worker, reason: str | None) -> None:
    """SIGKILLs a worker's process group now and asks the zygote to kill its sandbox uid."""
    for kill in (os.killpg, os.kill):
      try:
        kill(w.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    if self._zygote is not None:
      self._zygote.kill(w.pid, w.uid)
    if w.conn is not None:
      w.conn.close()
    w.conn = None
    w.uid = self._new_uid()  # a fresh uid: stragglers of the old one cannot touch the new worker
    if reason:
      log.debug("killed verifier worker %d: %s", w.pid, reason)

  # ---- scoring -----------------------------------------------------------------------------

  def score(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]], *,
            num_tokens: Sequence[int] | np.ndarray | None = None, group_size: int = 1, step: int = 0) -> RewardBatch:
    """Scores N completions.

    Args:
      completions: N strings, prompt-major: item i belongs to prompt i // group_size.
      examples: N examples (the example of each completion), or N // group_size (one per prompt).
      num_tokens: N completion token counts (needed by token-based components such as overlong).
      group_size: G, completions per prompt (group verifiers receive the G of a prompt).
      step: the training step (for weight schedules and step-aware verifiers).
    Returns:
      RewardBatch with rewards [N], components {name: [N]}, metrics and error messages.
    """
    if self._closed:
      raise RuntimeError("RewardPool.score called after close().")
    if os.getpid() != self._owner:
      raise RuntimeError("RewardPool.score called in a forked child of the process that created the pool; "
                         "create a RewardPool in the child instead.")
    n = len(completions)
    if group_size < 1 or n % group_size:
      raise ValueError(f"{n} completions are not a multiple of group_size={group_size}.")
    if len(examples) == n // group_size and group_size > 1:
      examples = [examples[i // group_size] for i in range(n)]
    if len(examples) != n:
      raise ValueError(f"got {n} completions but {len(examples)} examples; pass one example per completion "
                       f"or one per prompt ({n // group_size}).")
    completions = [c if isinstance(c, str) else str(c) for c in completions]
    examples = list(examples)
    tokens = None if num_tokens is None else [int(t) for t in np.asarray(num_tokens).reshape(-1)]
    if tokens is not None and len(tokens) != n:
      raise ValueError(f"num_tokens has {len(tokens)} entries for {n} completions.")
    for c, v in zip(self.spec.components, self.verifiers):
      if v.wants_num_tokens and tokens is None:
        raise ValueError(f"component '{c.name}' (verifier '{v.name}') needs completion token counts: "
                         "pass num_tokens= to score().")
    with self._lock:
      return self._score(completions, examples, tokens, group_size, int(step))

  def _score(self, completions, examples, tokens, group_size, step) -> RewardBatch:
    start = time.monotonic()
    spec = self.spec
    k, n = len(self.verifiers), len(completions)
    scores = np.zeros((k, n), np.float64)
    failed = np.zeros((k, n), bool)
    infos: list[list[dict | None]] = [[None] * n for _ in range(k)]
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []

    def record(task: _Task, results=None, error: str | None = None, kind: str = "errors") -> None:
      if error is None and results is not None:
        for i, (s, info) in zip(task.items, results):
          scores[task.comp, i] = s
          infos[task.comp][i] = info
        return
      fb = spec.components[task.comp].fallback
      fb = spec.fallback if fb is None else fb
      for i in task.items:
        scores[task.comp, i] = fb
        failed[task.comp, i] = True
        infos[task.comp][i] = {"failure": _LABELS[kind], "message": str(error)}
      counts[kind] += len(task.items)
      msg = f"[{spec.components[task.comp].name}] {_LABELS[kind]}: {error}"
      if len(errors) < _MAX_BATCH_ERRORS:
        errors.append(msg)
      if self._logged < spec.max_logged_errors:
        self._logged += 1
        log.warning("reward verifier failure (item %d): %s%s", task.items[0], msg,
                    "" if self._logged < spec.max_logged_errors else " (further failures are only counted)")

    tasks: list[_Task] = []
    local: list[_Task] = []
    for ci, v in enumerate(self.verifiers):
      if v.kind == "item":
        groups = [[i] for i in range(n)]
      elif v.kind == "group":
        groups = [list(range(p, p + group_size)) for p in range(0, n, group_size)]
      else:
        groups = [list(range(n))] if n else []
      for items in groups:
        t = _Task(self._next_tid, ci, items, spec.timeout_s * len(items))
        self._next_tid += 1
        (local if (v.inline or not self._remote_needed) else tasks).append(t)

    for t in local:
      self._run_local(t, completions, examples, tokens, step, record)
    if tasks:
      self._run_remote(tasks, completions, examples, tokens, step, record, counts, start + spec.batch_deadline_s)

    rewards, passed = combine(spec, scores, failed, step)
    metrics = batch_metrics(spec, rewards, scores, passed, infos, step)
    elapsed = time.monotonic() - start
    for key in ("timeouts", "errors", "crashes", "deadline_misses", "restarts"):
      metrics[f"verifier/{key}"] = float(counts[key])
      self.totals[key] += counts[key]
    metrics["verifier/failures"] = float(failed.sum())
    metrics["verifier/seconds"] = elapsed
    metrics["verifier/items_per_s"] = n / elapsed if elapsed > 0 else 0.0
    acc = spec.accuracy_index()
    answers = [(info or {}).get("answer") if isinstance((info or {}).get("answer"), str) else None
               for info in infos[acc]]
    return RewardBatch(rewards=rewards,
                       components={c.name: scores[i].astype(np.float32) for i, c in enumerate(spec.components)},
                       metrics=metrics, errors=errors, answers=answers,
                       failed={c.name: failed[i].copy() for i, c in enumerate(spec.components)},
                       infos={c.name: infos[i] for i, c in enumerate(spec.components)})

  def _payload(self, t: _Task, completions, examples, tokens, step) -> tuple:
    return (t.tid, t.comp, [completions[i] for i in t.items], [examples[i] for i in t.items],
            None if tokens is None else [tokens[i] for i in t.items], step)

  def _run_local(self, t: _Task, completions, examples, tokens, step, record) -> None:
    _, comp, cs, exs, toks, _ = self._payload(t, completions, examples, tokens, step)
    try:
      results = call_verifier(self.verifiers[comp], dict(self.spec.components[comp].kwargs), cs, exs, toks, step)
    except Exception as e:  # noqa: BLE001
      record(t, error=describe_exception(e))
      return
    record(t, results)

  def _run_remote(self, tasks: list[_Task], completions, examples, tokens, step, record, counts,
                  deadline: float) -> None:
    pending = collections.deque(tasks)
    workers = self._workers

    def fail_head(w: _Worker, kind: str, message: str) -> None:
      """The worker's current task failed with the worker: kill it, requeue the rest."""
      head = w.queue.popleft() if w.queue else None
      rest = list(w.queue)
      w.queue.clear()
      self._kill(w, message)
      if head is not None:
        record(head, error=message, kind=kind)
      pending.extendleft(reversed(rest))

    while pending or any(w.queue for w in workers):
      now = time.monotonic()
      if now >= deadline:
        break
      for w in workers:  # top up workers' queues, so they never wait for the next chunk
        if len(w.queue) > _REFILL_BELOW or not pending:
          continue
        if not w.alive:
          try:
            self._spawn(w)
          except Exception as e:  # noqa: BLE001 - counted below as items that could not run
            log.error("cannot start a verifier worker: %s", e)
            continue
          counts["restarts"] += 1
        size = max(1, min(_MAX_CHUNK, len(pending) // (2 * len(workers))))
        chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
        try:
          w.conn.send([self._payload(t, completions, examples, tokens, step) for t in chunk])
        except (OSError, EOFError, BrokenPipeError):
          pending.extendleft(reversed(chunk))
          self._kill(w, "send failed")
          continue
        if not w.queue:
          w.deadline = time.monotonic() + chunk[0].timeout
        w.queue.extend(chunk)
      for w in workers:
        if w.queue and w.conn is None:  # defensive: a worker lost without its items accounted
          fail_head(w, "crashes", "worker connection lost")
      busy = [w for w in workers if w.queue]
      if not busy:
        if pending and not any(w.alive for w in workers):
          # No worker could be started: fail what is left rather than spin.
          while pending:
            record(pending.popleft(), error="no verifier worker could be started", kind="crashes")
        continue
      wake = min([w.deadline for w in busy] + [deadline])
      ready = wait([w.conn for w in busy], timeout=max(0.0, wake - time.monotonic()))
      ready_ids = {id(c) for c in ready}
      for w in busy:
        if id(w.conn) in ready_ids:
          self._drain(w, record, fail_head, pending)
      now = time.monotonic()
      for w in workers:
        if w.queue and now >= w.deadline:
          head = w.queue[0]
          fail_head(w, "timeouts", f"timed out after {head.timeout:.1f}s")

    # Batch deadline: whatever is unfinished gets the fallback.
    for w in workers:
      if w.queue:
        while w.queue:
          record(w.queue.popleft(), error=f"batch deadline of {self.spec.batch_deadline_s:.0f}s passed",
                 kind="deadline_misses")
        self._kill(w, "batch deadline")
    while pending:
      record(pending.popleft(), error=f"batch deadline of {self.spec.batch_deadline_s:.0f}s passed",
             kind="deadline_misses")

  def _drain(self, w: _Worker, record, fail_head, pending: collections.deque) -> None:
    """Reads every reply the worker has sent; handles its death."""
    while w.conn is not None and w.queue:
      try:
        if not w.conn.poll():
          return
        tid, status, value, retire = w.conn.recv()
      except (EOFError, OSError, pickle.UnpicklingError, ValueError, TypeError) as e:
        fail_head(w, "crashes", f"worker process died ({type(e).__name__}; e.g. a segfault, os._exit or the "
                  "kernel's OOM killer)")
        return
      head = w.queue.popleft()
      if head.tid != tid:  # cannot happen with an ordered stream; be safe
        w.queue.appendleft(head)
        fail_head(w, "crashes", "worker protocol out of sync")
        return
      if status == "ok":
        record(head, value)
      else:
        record(head, error=value, kind="errors")
      if retire:  # the worker exits after a MemoryError; give its other tasks to others
        pending.extendleft(reversed(list(w.queue)))
        w.queue.clear()
        self._kill(w, "retired after MemoryError")
        return
      if w.queue:
        w.deadline = time.monotonic() + w.queue[0].timeout


_LIVE_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
  for pool in list(_LIVE_POOLS):
    try:
      pool.close()
    except Exception:  # noqa: BLE001
      pass
