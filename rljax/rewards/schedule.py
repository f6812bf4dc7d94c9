"""One batch's tasks over the pool's workers (rljax/rewards/pool.py owns the workers and the zygote).

`RemoteRun.run` feeds workers chunks of tasks without blocking, reads their replies (wire.py),
and turns timeouts, crashes, recycles and the batch deadline into the batch's records. Tasks of
workers that ended with a replaced zygote run again, convicting nobody; when the zygote dies
under running workers, each task that was running is re-run alone, and only one that takes its
worker down again is a crash.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import select
import time
from typing import Any, Callable

from rljax.rewards import wire
from rljax.rewards.processes import Lost, WorkerProc

log = logging.getLogger("rljax.rewards")

MAX_CHUNK = 8       # tasks per message to a worker
REFILL_BELOW = 2    # send a worker more tasks once it has at most this many queued


@dataclasses.dataclass
class Task:
  tid: int
  comp: int
  items: list[int]
  timeout: float
  solo: bool = False  # re-run alone after its worker died with the zygote


@dataclasses.dataclass
class Worker:
  wid: int
  uid: int | None
  proc: WorkerProc | None = None
  queue: collections.deque = dataclasses.field(default_factory=collections.deque)
  deadline: float = 0.0
  imports: list = dataclasses.field(default_factory=list)  # modules the running task started importing

  @property
  def alive(self) -> bool:
    return self.proc is not None

  @property
  def conn(self):
    return self.proc.channel

  @property
  def pid(self) -> int:
    """The worker's pid in the pool's process (0 when it is not running)."""
    return self.proc.pid if self.proc is not None else 0


class RemoteRun:
  """Runs `tasks` on `pool`'s workers until done or `deadline` (see the module doc).

  record(task, results=None, error=None, kind="errors") stores a task's outcome; note(task,
  kind, message) counts a problem that does not fail it; payload(task) is its request tuple.
  """

  def __init__(self, pool, tasks: list[Task], payload: Callable[[Task], tuple], record, note,
               counts: collections.Counter, deadline: float):
    self.pool = pool
    self.workers: list[Worker] = pool._workers
    self.pending = collections.deque(tasks)
    self.suspects: collections.deque = collections.deque()  # tasks of workers that died with the zygote
    self.payload, self.record, self.note, self.counts, self.deadline = payload, record, note, counts, deadline

  def lose(self, w: Worker, kind: str, message: str) -> None:
    """The worker failed on its current task: kill it, requeue the rest. A crash that comes with
    the zygote's death convicts nobody yet: every worker died with the zygote, and the task each
    was running is re-run alone."""
    zygote = self.pool._zygote
    with_zygote = kind == "crashes" and zygote is not None and not zygote.alive()
    victims = [w] + ([v for v in self.workers if v is not w and v.alive] if with_zygote else [])
    for v in victims:
      head = v.queue.popleft() if v.queue else None
      rest = list(v.queue)
      v.queue.clear()
      self.pool._kill(v, message if v is w else "died with the zygote")
      self.pending.extendleft(reversed(rest))
      if head is None:
        continue
      if with_zygote and not head.solo:
        head.solo = True
        self.suspects.append(head)
      else:
        self.record(head, error=f"{message}; run alone, it took the zygote down" if with_zygote else message,
                    kind=kind)

  def requeue_orphaned(self) -> None:
    """Tasks of workers that ended with a replaced zygote run again (they are not convicted)."""
    for v in self.workers:
      if v.queue and not v.alive:
        for t in reversed(v.queue):
          (self.suspects.appendleft if t.solo else self.pending.appendleft)(t)
        v.queue.clear()

  def dispatch(self, w: Worker, chunk: list[Task]) -> bool:
    if w.alive and not w.queue and w.conn.hung_up():
      self.pool._kill(w, "worker exited while idle")
    if not w.alive:
      try:
        self.pool._spawn(w)
      except Exception as e:  # noqa: BLE001 - counted by the caller as tasks that could not run
        log.error("cannot start a verifier worker: %s", e)
        return False
      finally:
        self.requeue_orphaned()
      self.counts["restarts"] += 1
    w.conn.queue([self.payload(t) for t in chunk])
    if not w.queue:
      w.deadline = time.monotonic() + chunk[0].timeout
      w.imports = []
    w.queue.extend(chunk)
    return True

  def timed_out(self, w: Worker) -> None:
    message = f"timed out after {w.queue[0].timeout:.1f}s"
    if w.imports:
      self.counts["import_timeouts"] += 1
      message += (f" while importing '{w.imports[0]}' inside the verifier: a new worker does not have it, so the "
                  "import runs (and times out) again in every worker; import it at module level or list it in "
                  "the verifier's preload=(...) so the zygote imports it once")
    self.lose(w, "timeouts", message)

  def run(self) -> None:
    workers, pending, suspects = self.workers, self.pending, self.suspects
    while pending or suspects or any(w.queue for w in workers):
      if time.monotonic() >= self.deadline:
        break
      if suspects or any(t.solo for w in workers for t in w.queue):
        # One suspect at a time, on an otherwise idle pool, so that a second death is its own.
        if suspects and not any(w.queue for w in workers):
          t = suspects.popleft()
          if not any(self.dispatch(w, [t]) for w in workers):
            self.record(t, error="no verifier worker could be started", kind="crashes")
      else:
        for w in workers:  # top up workers' queues, so they never wait for the next chunk
          if len(w.queue) > REFILL_BELOW or not pending:
            continue
          size = max(1, min(MAX_CHUNK, len(pending) // (2 * len(workers))))
          chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
          if not self.dispatch(w, chunk):
            pending.extendleft(reversed(chunk))
      busy = [w for w in workers if w.queue]
      if not busy:
        if (pending or suspects) and not any(w.alive for w in workers):
          # No worker could be started: fail what is left rather than spin.
          for t in [*pending, *suspects]:
            self.record(t, error="no verifier worker could be started", kind="crashes")
          pending.clear()
          suspects.clear()
        continue
      for w in busy:
        try:
          w.conn.flush()
        except Lost:  # it exited: the replies it sent first are still to be read (drain sees the end)
          w.conn.outbox.clear()
      wake = min([w.deadline for w in busy] + [self.deadline])
      queued = any(w.conn.pending for w in busy)  # frames left undecoded last round: no waiting
      poller = select.poll()
      for w in busy:
        poller.register(w.conn.fileno(), select.POLLIN | (select.POLLOUT if w.conn.outbox else 0))
      wait_ms = 0 if queued else max(0, math.ceil((wake - time.monotonic()) * 1000))
      ready = {fd for fd, _ in poller.poll(wait_ms)}
      for w in busy:
        if w.alive and (w.conn.fileno() in ready or w.conn.pending):
          self.drain(w)
      now = time.monotonic()
      for w in workers:
        if w.queue and now >= w.deadline:
          self.timed_out(w)

    # Batch deadline: whatever is unfinished gets the fallback.
    missed = f"batch deadline of {self.pool.spec.batch_deadline_s:.0f}s passed"
    for w in workers:
      if w.queue:
        while w.queue:
          self.record(w.queue.popleft(), error=missed, kind="deadline_misses")
        self.pool._kill(w, "batch deadline")
    for t in [*pending, *suspects]:
      self.record(t, error=missed, kind="deadline_misses")

  def drain(self, w: Worker) -> None:
    """Handles the messages the worker has sent (decoded within a time budget), then its death if
    it died. Never blocks: half a frame stays buffered until the rest comes or the task times out."""
    messages, ended = w.conn.read()
    for msg in messages:
      if not w.queue:
        self.lose(w, "crashes", "worker sent a reply nobody asked for")
        return
      head = w.queue[0]
      if msg.get("t") != head.tid:
        self.lose(w, "crashes", "worker protocol out of sync")
        return
      if "n" in msg:  # a note about the running task
        if msg.get("n") == "import" and isinstance(msg.get("m"), str):
          w.imports.append(msg["m"][:200])
        continue
      w.queue.popleft()
      w.imports = []
      self.reply(head, msg)
      if msg.get("x"):  # the item changed the worker's state: later items get a fresh worker
        self.recycle(w, head, str(msg["x"])[:300])
        return
      if w.queue:
        w.deadline = time.monotonic() + w.queue[0].timeout
    if ended is not None and w.alive:
      if w.queue and ended.startswith("corrupt"):
        self.lose(w, "crashes", f"worker wrote a {ended} onto its socket")
      elif w.queue:
        self.lose(w, "crashes", f"worker process died ({ended}; e.g. a segfault, os._exit or the kernel's OOM killer)")
      else:
        self.pool._kill(w, f"worker exited ({ended})")

  def reply(self, task: Task, msg: dict[str, Any]) -> None:
    if "e" in msg:
      self.record(task, error=str(msg["e"]), kind="errors")
      return
    results, error = wire.reply_results(msg, len(task.items))
    if error is not None:
      self.record(task, error=error, kind="errors")
      return
    if msg.get("d"):
      self.note(task, "info_errors", "info values dropped: " + "; ".join(map(str, msg["d"]))[:1000])
    self.record(task, results)

  def recycle(self, w: Worker, task: Task, reason: str) -> None:
    self.counts["recycles"] += 1
    seen = self.pool._recycle_reasons
    if reason not in seen and len(seen) < 20:
      seen.add(reason)
      log.warning("verifier '%s' %s; its worker is replaced after every such item, which costs a fork and the "
                  "worker's caches (leave the process as you found it: close what you open, join threads, restore "
                  "what you change; open long-lived resources at import or in the verifier's warmup=, which runs "
                  "once in the zygote and is inherited by every worker)", self.pool.verifiers[task.comp].name, reason)
    self.pending.extendleft(reversed(list(w.queue)))
    w.queue.clear()
    self.pool._kill(w, f"replaced: the item {reason}")
