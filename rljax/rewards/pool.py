"""RewardPool: scores completions with verifiers in worker processes that cannot hang,
crash or leak into the caller.

    with RewardPool(spec) as pool:
      out = pool.score(completions, examples, num_tokens=lengths, group_size=G, step=step)
      out.rewards, out.components, out.metrics

Guarantees (with num_workers > 0):
  * items cannot see each other: a worker whose process state an item changed (fds, cwd,
    environment, threads, timers, signals, rlimits, ids, memory growth; rljax/rewards/procstate.py)
    is replaced by a fresh fork of the zygote before its next item (verifier/recycles);
  * containment: the zygote is the init of a PID namespace and each worker runs under the init
    of its own (where the kernel allows; see rljax/rewards/zygote.py), so everything a verifier
    starts ends with its item, and everything the pool started ends with close();
  * a supervised zygote: a dead, stopped or silent zygote is replaced;
  * per-item timeout: a verifier call running past timeout_s (times its number of items
    for group/batch verifiers) is killed with its worker, which is replaced; a timeout during
    an import the zygote did not preload says so (verifier/import_timeouts);
  * per-batch deadline: `score` returns within about batch_deadline_s, items left
    unscored get the fallback;
  * crash isolation: a worker that dies (segfault, os._exit, OOM kill) is replaced and
    its item gets the fallback. When the zygote dies (all workers die with it), the items
    that were running are not convicted: each is re-run alone, and only one that kills
    its worker again counts as a crash;
  * bounded memory: each worker has RLIMIT_AS = max_memory_mb;
  * bad results: a score that is not finite in float32, or an info dict that metrics
    cannot average, is an error of that item (never an exception in `score`); info values
    that are not plain data are dropped (verifier/info_errors), the score is kept;
  * replies are plain data (JSON, at most wire.MAX_REPLY bytes), decoded within a time budget
    per poll round: nothing a worker sends runs code in this process.
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
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import ConfigError
from rljax.rewards import routing, sandbox, wire
from rljax.rewards.base import FLOAT32_MAX, Verifier
from rljax.rewards.compose import RewardBatch, accuracy_components, batch_metrics, combine
from rljax.rewards.processes import Zygote as _Zygote, ZygoteLost as _ZygoteLost
from rljax.rewards.schedule import RemoteRun, Task, Worker
from rljax.rewards.spec import RewardSpec
from rljax.rewards.worker import call_verifier, describe_exception

log = logging.getLogger("rljax.rewards")

_MAX_BATCH_ERRORS = 20
_LABELS = {"timeouts": "timeout", "errors": "error", "crashes": "crash", "deadline_misses": "deadline"}
COUNTERS = ("timeouts", "errors", "crashes", "deadline_misses", "restarts", "recycles", "info_errors",
            "import_timeouts")
_ZYGOTE_RESTARTS_PER_BATCH = 3


class RewardPool:
  """Scores completions with the components of a RewardSpec (see the module doc)."""

  def __init__(self, spec: RewardSpec | Mapping[str, Any]):
    if not isinstance(spec, RewardSpec):
      spec = RewardSpec.from_dict(spec)
    spec.validate()
    self.spec = spec
    self.routes: list[routing.Route] = spec.routes()
    self.verifiers: list[Verifier] = [r.verifier for r in self.routes]   # a task's `comp` indexes both
    self.component_names = spec.component_names
    self._lock = threading.RLock()
    self._owner = os.getpid()
    self._zygote: _Zygote | None = None
    self._workers: list[Worker] = []
    self._next_tid = 0
    self._logged = 0
    self._closed = False
    self._recycle_reasons: set[str] = set()
    self.totals: collections.Counter = collections.Counter()
    self._remote_needed = spec.num_workers > 0 and any(not v.inline for v in self.verifiers)
    if any(v.warmup is sandbox.isolation for v in self.verifiers):
      self._check_sandbox()
    _LIVE_POOLS.add(self)
    if self._remote_needed:
      try:
        self._zygote = self._new_zygote()
        self._workers = [Worker(wid=i, uid=self._new_uid()) for i in range(spec.num_workers)]
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
    return [(r.verifier, dict(r.kwargs)) for r in self.routes]

  def _new_zygote(self) -> _Zygote:
    z = _Zygote(self._remote_components(), self.spec.max_memory_mb)
    if z.containment != "pid-namespace" and not self.totals["zygote_restarts"]:
      log.warning("verifier pool without PID namespaces (%s): workers fall back to sweeping their descendants, "
                  "which a process that leaves the tree can escape (docs/rewards.md)", z.note)
    return z

  @property
  def containment(self) -> str | None:
    """How the pool contains its processes: 'pid-namespace', 'subreaper' or None (no workers)."""
    return self._zygote.containment if self._zygote is not None else None

  def process_ids(self) -> set[int]:
    """The pids of the pool's own processes (the zygote's launcher, the zygote, live workers)."""
    pids = set().union(*[w.proc.pids() for w in self._workers if w.alive])
    if self._zygote is not None:
      pids |= {self._zygote.proc.pid, self._zygote.pid}
    return pids

  def _rss_mb(self) -> float:
    """How far a worker's resident memory may grow before it is replaced: a quarter of what the
    memory limit leaves after the zygote's own mappings, between 32 and 256 MB."""
    headroom = self.spec.max_memory_mb - self._zygote.address_space_mb
    return float(min(256.0, max(32.0, headroom / 4)))

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

  def _supervise(self) -> None:
    """Replaces a zygote that is dead or stopped (checked before every batch: it costs a read
    of /proc/<pid>/stat), or starts one where an earlier replacement failed."""
    state = self._zygote.state() if self._zygote is not None else "missing"
    if state != "running":
      self._restart_zygote(f"it is {state}")

  def _spawn(self, w: Worker) -> None:
    """Starts w; a zygote that is dead, stopped or silent is replaced (a few times per batch)."""
    for attempt in range(_ZYGOTE_RESTARTS_PER_BATCH + 1):
      try:
        if self._zygote is None:
          raise _ZygoteLost("no verifier zygote (an earlier replacement failed)")
        w.proc = self._zygote.spawn(w.wid, w.uid, self._rss_mb())
        break
      except _ZygoteLost as e:
        if attempt == _ZYGOTE_RESTARTS_PER_BATCH:
          raise
        self._restart_zygote(str(e))
    w.queue.clear()
    w.imports = []

  def _restart_zygote(self, why: str) -> None:
    """Replaces the zygote; its workers end with it (their queues stay, for the batch to requeue)."""
    log.warning("verifier zygote replaced: %s", why)
    old, self._zygote = self._zygote, None
    for w in self._workers:
      if w.alive:
        self._kill(w, "its zygote was replaced")
    if old is not None:
      old.terminate()
    self._zygote = self._new_zygote()
    self.totals["zygote_restarts"] += 1

  def _kill(self, w: Worker, reason: str | None) -> None:
    """SIGKILLs a worker now and asks the zygote to reap it and clean up after it."""
    w.proc.kill()
    if self._zygote is not None and self._zygote.alive():
      self._zygote.kill(w.proc, w.uid)
    elif w.proc.containment != "pid-namespace":  # nobody else is left to kill what runs as its sandbox uid
      sandbox.kill_uid(w.uid)
    if reason:
      log.debug("killed verifier worker %d: %s", w.proc.pid, reason)
    w.proc.close()
    w.proc = None
    w.uid = self._new_uid()  # a fresh uid: stragglers of the old one cannot touch the new worker

  # ---- scoring -----------------------------------------------------------------------------
  def score(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]], *,
            num_tokens: Sequence[int] | np.ndarray | None = None, group_size: int = 1, step: int = 0,
            precomputed: Mapping[str, Sequence[float] | np.ndarray] | None = None) -> RewardBatch:
    """Scores N completions.

    Args:
      completions: N strings, prompt-major: item i belongs to prompt i // group_size.
      examples: N examples (the example of each completion), or N // group_size (one per prompt).
      num_tokens: N completion token counts (needed by token-based components such as overlong).
      group_size: G, completions per prompt (group verifiers receive the G of a prompt).
      step: the training step (for weight schedules and step-aware verifiers).
      precomputed: {name: [N] scores} of the in-graph components (reward models and judges,
        scored in the compiled step: rljax/rewards/graph.py); one that is absent scores no item
        (e.g. in an evaluation that runs no model). A non-finite score fails its item (fallback).
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
    for r in self.routes:
      if r.verifier.wants_num_tokens and tokens is None:
        raise ValueError(f"component '{self.spec.components[r.component].name}' (verifier '{r.verifier.name}') "
                         "needs completion token counts: pass num_tokens= to score().")
    graph_scores = {}
    for name, values in (precomputed or {}).items():
      if name not in self.component_names or not self.spec.components[self.component_names.index(name)].in_graph:
        raise ValueError(f"precomputed scores for {name!r}, which is not a reward model or judge component of the "
                         f"spec ({[c.name for c in self.spec.graph_components]}).")
      values = np.asarray(values, np.float64).reshape(-1)
      if values.shape[0] != n:
        raise ValueError(f"precomputed scores for {name!r} have {values.shape[0]} entries for {n} completions.")
      graph_scores[name] = values
    with self._lock:
      return self._score(completions, examples, tokens, group_size, int(step), graph_scores)

  def _score(self, completions, examples, tokens, group_size, step, graph_scores=None) -> RewardBatch:
    start = time.monotonic()
    spec = self.spec
    k, n = len(spec.components), len(completions)
    scores = np.zeros((k, n), np.float64)
    failed = np.zeros((k, n), bool)
    applies = np.zeros((k, n), bool)
    infos: list[list[dict | None]] = [[None] * n for _ in range(k)]
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []
    labels = routing.row_labels(examples)
    component_of = lambda task: self.routes[task.comp].component   # noqa: E731 - a task's comp is its route

    def note(task: Task, kind: str, message: str) -> None:
      """Counts and logs a problem of a task that does not fail it."""
      counts[kind] += 1
      msg = f"[{spec.components[component_of(task)].name}] {message}"
      if len(errors) < _MAX_BATCH_ERRORS:
        errors.append(msg)
      if self._logged < spec.max_logged_errors:
        self._logged += 1
        log.warning("reward verifier (item %d): %s", task.items[0], msg)

    def record(task: Task, results=None, error: str | None = None, kind: str = "errors") -> None:
      ci = component_of(task)
      if error is None and results is not None:
        error = _bad_results(results, len(task.items))
      if error is None and results is not None:
        fb = spec.components[ci].fallback
        fb = spec.fallback if fb is None else fb
        lost = []
        for i, (s, info) in zip(task.items, results):
          if s is None:   # an item the verifier could not score (base.ItemFailure)
            lost.append(i)
            scores[ci, i], failed[ci, i] = fb, True
            infos[ci][i] = {"failure": "error", "message": str((info or {}).get("error"))}
          else:
            scores[ci, i] = s
            infos[ci][i] = info
        if lost:
          counts["errors"] += len(lost)
          msg = f"[{spec.components[ci].name}] error on {len(lost)} item(s): {infos[ci][lost[0]]['message']}"
          if len(errors) < _MAX_BATCH_ERRORS:
            errors.append(msg)
          if self._logged < spec.max_logged_errors:
            self._logged += 1
            log.warning("reward verifier failure (item %d): %s", lost[0], msg)
        return
      fb = spec.components[ci].fallback
      fb = spec.fallback if fb is None else fb
      for i in task.items:
        scores[ci, i] = fb
        failed[ci, i] = True
        infos[ci][i] = {"failure": _LABELS[kind], "message": str(error)}
      counts[kind] += len(task.items)
      msg = f"[{spec.components[ci].name}] {_LABELS[kind]}: {error}"
      if len(errors) < _MAX_BATCH_ERRORS:
        errors.append(msg)
      if self._logged < spec.max_logged_errors:
        self._logged += 1
        log.warning("reward verifier failure (item %d): %s%s", task.items[0], msg,
                    "" if self._logged < spec.max_logged_errors else " (further failures are only counted)")

    if self._remote_needed:
      try:
        self._supervise()
      except Exception as e:  # noqa: BLE001 - the batch's items then fail as "no worker could be started"
        log.error("cannot start a verifier zygote: %s", e)
    tasks: list[Task] = []
    local: list[Task] = []
    for ri, r in enumerate(self.routes):
      mine = routing.route_rows(labels, r.labels, spec.components[r.component].name)
      applies[r.component] |= mine
      rows = np.nonzero(mine)[0].tolist()
      if r.verifier.kind == "item":
        groups = [[i] for i in rows]
      elif r.verifier.kind == "group":   # the rows of one prompt share its example, so its source
        groups = [g for p in range(0, n, group_size) if (g := [i for i in range(p, p + group_size) if mine[i]])]
      else:
        groups = [rows] if rows else []
      for items in groups:
        t = Task(self._next_tid, ri, items, spec.timeout_s * len(items))
        self._next_tid += 1
        (local if (r.verifier.inline or not self._remote_needed) else tasks).append(t)

    for k, c in enumerate(spec.components):
      if c.in_graph and c.name in (graph_scores or {}):
        mine = routing.route_rows(labels, routing.coverage(c), c.name)
        applies[k] = mine
        values = graph_scores[c.name]
        bad = mine & ~(np.isfinite(values) & (np.abs(values) <= FLOAT32_MAX))
        scores[k] = np.where(mine & ~bad, values, 0.0)
        if bad.any():
          fb = spec.fallback if c.fallback is None else c.fallback
          scores[k, bad] = fb
          failed[k] = bad
          counts["errors"] += int(bad.sum())
          msg = f"[{c.name}] error: the model's score is not finite on {int(bad.sum())} item(s)"
          if len(errors) < _MAX_BATCH_ERRORS:
            errors.append(msg)
          for i in np.nonzero(bad)[0]:
            infos[k][i] = {"failure": "error", "message": msg}
    for t in local:
      self._run_local(t, completions, examples, tokens, step, record, note)
    if tasks:
      RemoteRun(self, tasks, lambda t: self._payload(t, completions, examples, tokens, step), record, note, counts,
                start + spec.batch_deadline_s).run()

    rewards, passed = combine(spec, scores, failed, step, applies)
    metric_rows: dict[str, int] = {}
    metrics = batch_metrics(spec, rewards, scores, passed, infos, step, applies,
                            labels if any(label is not None for label in labels) else None, metric_rows)
    elapsed = time.monotonic() - start
    for key in COUNTERS:
      metrics[f"verifier/{key}"] = float(counts[key])
      self.totals[key] += counts[key]
    metrics["verifier/failures"] = float(failed.sum())
    metrics["verifier/seconds"] = elapsed
    metrics["verifier/items_per_s"] = n / elapsed if elapsed > 0 else 0.0
    acc = accuracy_components(spec, applies)
    answers = [None] * n
    for i, a in enumerate(acc.tolist()):
      answer = (infos[a][i] or {}).get("answer") if a >= 0 else None
      answers[i] = answer if isinstance(answer, str) else None
    return RewardBatch(rewards=rewards,
                       components={c.name: scores[i].astype(np.float32) for i, c in enumerate(spec.components)},
                       metrics=metrics, errors=errors, answers=answers,
                       failed={c.name: failed[i].copy() for i, c in enumerate(spec.components)},
                       infos={c.name: infos[i] for i, c in enumerate(spec.components)},
                       applies={c.name: applies[i].copy() for i, c in enumerate(spec.components)},
                       metric_rows=metric_rows)

  def _payload(self, t: Task, completions, examples, tokens, step) -> tuple:
    return (t.tid, t.comp, [completions[i] for i in t.items], [examples[i] for i in t.items],
            None if tokens is None else [tokens[i] for i in t.items], step)

  def _run_local(self, t: Task, completions, examples, tokens, step, record, note) -> None:
    _, comp, cs, exs, toks, _ = self._payload(t, completions, examples, tokens, step)
    try:
      results = call_verifier(self.verifiers[comp], dict(self.routes[comp].kwargs), cs, exs, toks, step)
    except Exception as e:  # noqa: BLE001
      record(t, error=describe_exception(e))
      return
    dropped: list[str] = []  # the same plain-data rule as for workers' replies
    results = [(s, None if info is None else _plain_info(info, dropped)) for s, info in results]
    if dropped:
      note(t, "info_errors", "info values dropped: " + "; ".join(dropped[:5]))
    record(t, results)


def _plain_info(info: dict, dropped: list[str]) -> dict | None:
  out = wire.plain(info, "info", dropped)
  return out if isinstance(out, dict) else None


def _bad_results(results: Any, n: int) -> str | None:
  """Why results for n items are unusable (None when they are fine)."""
  if not isinstance(results, list) or len(results) != n:
    return f"malformed reply: expected {n} results"
  for r in results:
    if isinstance(r, tuple) and len(r) == 2 and r[0] is None and isinstance(r[1], dict):
      continue   # an ItemFailure
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
