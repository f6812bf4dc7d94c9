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
    its item gets the fallback. When the zygote dies (all workers die with it), the items
    that were running are not convicted: each is re-run alone, and only one that kills
    its worker again counts as a crash;
  * bounded memory: each worker has RLIMIT_AS = max_memory_mb;
  * bad results: a score that is not finite in float32, or an info dict that metrics
    cannot average, is an error of that item (never an exception in `score`);
  * no leaks: a verifier's processes (setsid'd daemons too) are killed when its item
    ends; close() kills the workers, their processes and the zygote.
Every failure is counted in the metrics (verifier/timeouts, verifier/errors,
verifier/crashes, verifier/deadline_misses) and the first error messages are logged.

`score` only uses non-blocking sockets and poll (no signals): reading a worker's reply
never waits past the item's timeout or the batch deadline, even if the worker wrote half a
frame and hung. It is safe to call from any thread, including a
`jax.experimental.io_callback` inside a jitted step.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import math
import os
import select
import signal
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import ConfigError
from rljax.rewards import sandbox
from rljax.rewards.base import FLOAT32_MAX, Verifier
from rljax.rewards.compose import RewardBatch, batch_metrics, combine
from rljax.rewards.spec import RewardSpec
from rljax.rewards.processes import Channel as _Channel, Lost as _Lost, Zygote as _Zygote
from rljax.rewards.worker import call_verifier, describe_exception

log = logging.getLogger("rljax.rewards")

_MAX_BATCH_ERRORS = 20
_LABELS = {"timeouts": "timeout", "errors": "error", "crashes": "crash", "deadline_misses": "deadline"}
_MAX_CHUNK = 8       # tasks per message to a worker
_REFILL_BELOW = 2    # send a worker more tasks once it has at most this many queued


@dataclasses.dataclass
class _Task:
  tid: int
  comp: int
  items: list[int]
  timeout: float
  solo: bool = False  # re-run alone after its worker died with the zygote


@dataclasses.dataclass
class _Worker:
  wid: int
  uid: int | None
  pid: int = 0
  conn: _Channel | None = None
  queue: collections.deque = dataclasses.field(default_factory=collections.deque)
  deadline: float = 0.0

  @property
  def alive(self) -> bool:
    return self.conn is not None


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
    if any(v.warmup is sandbox.isolation for v in self.verifiers):
      self._check_sandbox()
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

  def _check_sandbox(self) -> None:
    """Probes the code sandbox once at start-up (which warns loudly when it cannot isolate)
    and refuses to start then if the spec requires isolation."""
    iso = sandbox.isolation()
    if not iso.isolated and self.spec.sandbox.get("require_isolation"):
      raise ConfigError(f"rewards.sandbox.require_isolation is set, but the code sandbox cannot isolate model "
                        f"code on this machine: {iso.note}")

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
    # Workers of the old zygote died with it (PDEATHSIG); _run_remote re-ran their items alone.

  def _kill(self, w: _Worker, reason: str | None) -> None:
    """SIGKILLs a worker's process group now and asks the zygote to kill its sandbox uid."""
    for kill in (os.killpg, os.kill):
      try:
        kill(w.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    if self._zygote is not None and self._zygote.alive():
      self._zygote.kill(w.pid, w.uid)
    else:  # nobody else is left to kill what runs as the worker's sandbox uid
      sandbox.kill_uid(w.uid)
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
        error = _bad_results(results, len(task.items))
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
    suspects: collections.deque = collections.deque()  # items of workers that died with the zygote
    workers = self._workers

    def lose(w: _Worker, kind: str, message: str) -> None:
      """The worker failed on its current task: kill it, requeue the rest. A crash that
      comes with the zygote's death convicts nobody yet: every worker died with the zygote,
      and the task each was running is re-run alone."""
      with_zygote = kind == "crashes" and self._zygote is not None and not self._zygote.alive()
      victims = [w] + ([v for v in workers if v is not w and v.alive] if with_zygote else [])
      for v in victims:
        head = v.queue.popleft() if v.queue else None
        rest = list(v.queue)
        v.queue.clear()
        self._kill(v, message if v is w else "died with the zygote")
        pending.extendleft(reversed(rest))
        if head is None:
          continue
        if with_zygote and not head.solo:
          head.solo = True
          suspects.append(head)
        else:
          record(head, error=f"{message}; run alone, it took the zygote down" if with_zygote else message,
                 kind=kind)

    def dispatch(w: _Worker, chunk: list[_Task]) -> bool:
      if w.alive and not w.queue and w.conn.hung_up():
        self._kill(w, "worker exited while idle")
      if not w.alive:
        try:
          self._spawn(w)
        except Exception as e:  # noqa: BLE001 - counted below as items that could not run
          log.error("cannot start a verifier worker: %s", e)
          return False
        counts["restarts"] += 1
      w.conn.queue([self._payload(t, completions, examples, tokens, step) for t in chunk])
      if not w.queue:
        w.deadline = time.monotonic() + chunk[0].timeout
      w.queue.extend(chunk)
      return True

    while pending or suspects or any(w.queue for w in workers):
      if time.monotonic() >= deadline:
        break
      if suspects or any(t.solo for w in workers for t in w.queue):
        # One suspect at a time, on an otherwise idle pool, so that a second death is its own.
        if suspects and not any(w.queue for w in workers):
          t = suspects.popleft()
          if not any(dispatch(w, [t]) for w in workers):
            record(t, error="no verifier worker could be started", kind="crashes")
      else:
        for w in workers:  # top up workers' queues, so they never wait for the next chunk
          if len(w.queue) > _REFILL_BELOW or not pending:
            continue
          size = max(1, min(_MAX_CHUNK, len(pending) // (2 * len(workers))))
          chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
          if not dispatch(w, chunk):
            pending.extendleft(reversed(chunk))
      busy = [w for w in workers if w.queue]
      if not busy:
        if (pending or suspects) and not any(w.alive for w in workers):
          # No worker could be started: fail what is left rather than spin.
          for t in [*pending, *suspects]:
            record(t, error="no verifier worker could be started", kind="crashes")
          pending.clear()
          suspects.clear()
        continue
      for w in busy:
        try:
          w.conn.flush()
        except _Lost as e:
          lose(w, "crashes", f"worker process died ({e})")
      busy = [w for w in busy if w.alive]
      wake = min([w.deadline for w in busy] + [deadline])
      poller = select.poll()
      for w in busy:
        poller.register(w.conn.fileno(), select.POLLIN | (select.POLLOUT if w.conn.outbox else 0))
      ready = {fd for fd, _ in poller.poll(max(0, math.ceil((wake - time.monotonic()) * 1000)))}
      for w in busy:
        if w.alive and w.conn.fileno() in ready:
          self._drain(w, record, lose, pending)
      now = time.monotonic()
      for w in workers:
        if w.queue and now >= w.deadline:
          lose(w, "timeouts", f"timed out after {w.queue[0].timeout:.1f}s")

    # Batch deadline: whatever is unfinished gets the fallback.
    missed = f"batch deadline of {self.spec.batch_deadline_s:.0f}s passed"
    for w in workers:
      if w.queue:
        while w.queue:
          record(w.queue.popleft(), error=missed, kind="deadline_misses")
        self._kill(w, "batch deadline")
    for t in [*pending, *suspects]:
      record(t, error=missed, kind="deadline_misses")

  def _drain(self, w: _Worker, record, lose, pending: collections.deque) -> None:
    """Handles every complete reply the worker has sent, then its death if it died. Never
    blocks: half a frame stays buffered until the rest comes or the task times out."""
    replies, ended = w.conn.read()
    for reply in replies:
      if not w.queue:
        lose(w, "crashes", "worker sent a reply nobody asked for")
        return
      head = w.queue[0]
      if not (isinstance(reply, tuple) and len(reply) == 4 and reply[0] == head.tid):
        lose(w, "crashes", "worker protocol out of sync")
        return
      w.queue.popleft()
      _, status, value, retire = reply
      if status == "ok":
        record(head, value)
      else:
        record(head, error=str(value), kind="errors")
      if retire:  # the worker exits after a MemoryError; give its other tasks to others
        pending.extendleft(reversed(list(w.queue)))
        w.queue.clear()
        self._kill(w, "retired after MemoryError")
        return
      if w.queue:
        w.deadline = time.monotonic() + w.queue[0].timeout
    if ended is not None and w.alive:
      if w.queue and ended.startswith("corrupt"):
        lose(w, "crashes", f"worker wrote a {ended} onto its socket")
      elif w.queue:
        lose(w, "crashes", f"worker process died ({ended}; e.g. a segfault, os._exit or the kernel's OOM killer)")
      else:
        self._kill(w, f"worker exited ({ended})")


def _bad_results(results: Any, n: int) -> str | None:
  """Why a worker's results for n items are unusable (None when they are fine)."""
  if not isinstance(results, list) or len(results) != n:
    return f"malformed reply: expected {n} results"
  for r in results:
    if not (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], float) and
            (r[1] is None or isinstance(r[1], dict))):
      return "malformed reply: expected (score, info) pairs"
    if not math.isfinite(r[0]) or abs(r[0]) > FLOAT32_MAX:
      return f"score {r[0]} is not finite in float32"
  return None


_LIVE_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
  for pool in list(_LIVE_POOLS):
    try:
      pool.close()
    except Exception:  # noqa: BLE001
      pass
