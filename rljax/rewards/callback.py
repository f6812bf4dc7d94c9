"""The bridge from a jitted training step to the reward pool (jax.experimental.io_callback).

    reward_fn = make_reward_fn(pool, tokenizer.batch_decode, group_size=G, mesh=mesh)
    reward_fn.set_batch(examples, step=step, indices=global_prompt_indices)   # host, before the step
    ...inside jit:
    rewards, components = reward_fn(tokens, lengths)  # [N, T] int32, [N] int32 -> [N] f32, [N, K] f32
    ...after the step, on every process:
    reward_fn.global_metrics()                        # the pool's metrics, combined over processes

Scoring is per host. With a mesh, the callback runs inside `jax.shard_map`, once per device,
on the rows that device holds (the rows are sharded like the prompts: row r belongs to prompt
r // G, so a device's rows are whole groups). Each process gathers its own devices' rows,
decodes and scores them once in its own pool (replicas over the other mesh axes are scored
once), and hands every device its slice; rewards come back sharded like the rows. No process
sees another's examples: `set_batch` takes the process's examples and their global prompt (or
row) indices, `local_indices` below computes them from the prompt batch's sharding. Without a
mesh the callback scores the whole batch on one device, as before.

The pool's metrics (`last_metrics`) describe the rows this process scored in the step, over every
callback round of it (devices that reach the callback more than gather_timeout_s apart are scored
in rounds: the step's metrics merge them, rljax/rewards/summaries.py); `global_metrics` combines
them over processes (a small host all-gather: call it on every process, after the step).

Why the callback's inputs are passed in pieces of at most 96 KiB: jax's io_callback copies each
argument onto the first CPU device before the host function sees it, and the CPU client makes a
copy larger than 100 KiB asynchronously on the thread pool that also runs the devices' programs.
On simulated CPU devices, when the other devices have already entered a collective (each one
blocking a pool thread), that copy never runs and the step deadlocks (measured on jax 0.10.2:
8 devices, one callback argument of 104 KiB per device hangs; 96 KiB does not).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rljax.rewards import summaries
from rljax.rewards.compose import RewardBatch
from rljax.rewards.pool import RewardPool
from rljax.rewards.summaries import combine_process_metrics  # noqa: F401  (re-exported: its old home)

log = logging.getLogger("rljax.rewards")

# The largest callback argument the CPU client copies synchronously is 100 KiB (module doc).
_PIECE_BYTES = 96 * 1024
# How long a device's callback waits for the process's other devices before scoring alone.
DEFAULT_GATHER_TIMEOUT_S = 30.0


def local_indices(sharding, shape) -> np.ndarray:
  """The global indices along dim 0 that this process's devices hold (`rljax.sharding.local_indices`)."""
  from rljax.sharding import local_indices as impl  # jax is imported lazily: verifier workers import this module
  return impl(sharding, shape)


class _Round:
  """The callbacks of one step on this process: the rows its devices hold, scored once."""

  def __init__(self, expected: int):
    self.expected = expected
    self.arrivals: list[tuple] = []   # (rows, tokens, lengths, graph scores or None)
    self.start = time.perf_counter()
    self.closed = False       # no more arrivals join (all came, or a waiter stopped waiting)
    self.scoring = False
    self.scored = False       # the rows this round claimed are scored (results or error set)
    self.done = False
    self.error: BaseException | None = None
    self.results: dict[int, tuple[float, np.ndarray]] = {}


class RewardFn:
  """Host state plus the jit-side call of the reward callback (see the module doc).

  Args:
    pool: the RewardPool scoring this process's rows.
    decode_fn: list of token-id lists -> list of strings.
    group_size: G, completions per prompt.
    mesh: score per device shard on this mesh (per host); None scores the whole batch at once.
    gather_timeout_s: how long a device's callback waits for the process's other devices
      before scoring its rows alone (a warning is logged when that happens).
    graph: the spec's reward models and judges (rljax/rewards/reward_models.py GraphScorer), scored
      in the step before the callback; their scores join the pool's components on the host.
  """

  def __init__(self, pool: RewardPool, decode_fn: Callable[[list[list[int]]], Sequence[str]], *,
               group_size: int = 1, mesh: Any = None, gather_timeout_s: float = DEFAULT_GATHER_TIMEOUT_S,
               graph: Any = None):
    self.pool = pool
    self.graph = graph if graph is not None and len(graph) else None
    self._graph_jit = None
    self.decode_fn = decode_fn
    self.group_size = int(group_size)
    self.mesh = mesh
    self.gather_timeout_s = float(gather_timeout_s)
    self.component_names = list(pool.component_names)
    self._lock = threading.Lock()
    self._cv = threading.Condition(self._lock)
    self._examples: list[Mapping[str, Any]] | None = None
    self._indices: np.ndarray | None = None
    self._per_row: bool | None = None
    self._step = 0
    self._round: _Round | None = None
    # The step's scoring calls: one, or several rounds when devices reach the callback far apart.
    self._parts: list[tuple[RewardBatch, np.ndarray, np.ndarray]] = []   # (batch, rows, rewards)
    self._timing: dict[str, float] | None = None
    # The step's claimed rows by global index: (token ids, the _Round scoring them). A replica of a
    # row (a device on another mesh axis holding the same shard) reaching the callback in a later
    # round takes that round's results instead of being scored, and published, a second time.
    self._scored: dict[int, tuple[np.ndarray, _Round]] = {}

  # ---- host side ------------------------------------------------------------------------------

  def set_batch(self, examples: Sequence[Mapping[str, Any]], step: int = 0, group_size: int | None = None, *,
                indices: Sequence[int] | np.ndarray | None = None, per_row: bool | None = None) -> None:
    """The examples of the next call: one per prompt or one per completion (prompt-major).

    indices: the global prompt index (per_row: row index) of each example; None when the
      examples cover the whole batch in order (one process, or gathered). On several processes
      pass `local_indices(prompt_sharding, num_prompts)`: each process then scores only the
      rows its devices hold, against its own examples.
    per_row: whether there is one example per completion; None decides by count (N or N // G).
    """
    with self._lock:
      self._examples = list(examples)
      self._indices = None if indices is None else np.asarray(indices, np.int64).reshape(-1)
      if self._indices is not None and len(self._indices) != len(self._examples):
        raise ValueError(f"set_batch got {len(self._examples)} examples but {len(self._indices)} indices.")
      self._per_row = per_row
      self._step = int(step)
      self._parts, self._timing, self._scored = [], None, {}   # a new step: metrics cover the rows scored from now
      if group_size is not None:
        self.group_size = int(group_size)

  def _lookup(self, rows: np.ndarray, n_total: int) -> list[Mapping[str, Any]]:
    """The example of each global row index (raises naming the missing prompt)."""
    examples, indices, g = self._examples, self._indices, max(self.group_size, 1)
    if examples is None:
      raise RuntimeError("reward_fn.set_batch(examples, step) must be called before the jitted step.")
    per_row = self._per_row
    if indices is None:
      if per_row is None:
        per_row = len(examples) == n_total
      if len(examples) != (n_total if per_row else n_total // g) or n_total % g:
        raise ValueError(f"reward_fn got {n_total} completions for {len(examples)} examples with group_size={g}; "
                         "set_batch needs one example per prompt (N // G) or per completion (N), or indices=.")
      return [examples[r if per_row else r // g] for r in rows.tolist()]
    table = {int(i): e for i, e in zip(indices, examples)}
    out = []
    for r in rows.tolist():
      key = r if per_row else r // g
      if key not in table:
        raise RuntimeError(f"reward callback: {'row' if per_row else 'prompt'} {key} is held by this process's "
                           "devices but set_batch(indices=...) has no example for it; pass the global indices "
                           "of this process's prompts (rljax.rewards.callback.local_indices).")
      out.append(table[key])
    return out

  def host_fn(self, tokens: np.ndarray, lengths: np.ndarray, rows: np.ndarray | None = None,
              n_total: int | None = None, graph_scores: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decodes and scores rows on the host; returns (rewards [n] f32, components [n, K] f32).

    tokens [n, T], lengths [n]; rows [n] their global row indices and n_total the batch's N
    (defaults: the n rows are the whole batch, in order); graph_scores [n, K_graph] the in-graph
    components' scores of the rows.
    """
    start = time.perf_counter()
    tokens = np.asarray(tokens)
    n = tokens.shape[0]
    rows = np.arange(n) if rows is None else np.asarray(rows, np.int64).reshape(-1)
    with self._lock:
      step, g = self._step, self.group_size
      examples = self._lookup(rows, n if n_total is None else int(n_total))
    rewards, comps, out = self._score_rows(tokens, lengths, examples, step, g, rows, graph_scores)
    with self._lock:
      self._publish(out, rows, rewards, start)
    return rewards, comps

  def _publish(self, out: RewardBatch, rows: np.ndarray, rewards: np.ndarray, start: float) -> None:
    """Adds a scoring call's results to the step's (a call whose rows were already scored starts a
    new step: the step ran again without set_batch)."""
    if any(np.intersect1d(rows, part[1]).size for part in self._parts):
      self._parts, self._timing, self._scored = [], None, {}
    self._parts.append((out, rows, rewards))
    first = start if self._timing is None else min(self._timing["start"], start)
    self._timing = {"start": first, "end": time.perf_counter()}

  def _score_rows(self, tokens, lengths, examples, step, g, rows, graph_scores=None):
    """Scores rows [n] (sorted global indices, whole groups) against their examples."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(-1).astype(np.int64)
    n = tokens.shape[0]
    g = max(int(g), 1)
    blocks = rows.reshape(-1, g) if n % g == 0 else None
    if blocks is None or not np.array_equal(blocks, blocks[:, :1] // g * g + np.arange(g)):
      raise ValueError(f"reward callback: the {n} rows on this process are not whole groups of {g} "
                       "(group verifiers need every completion of a prompt); make train.prompts_per_step "
                       "divisible by the product of mesh.shape's data and fsdp axes.")
    return self._decode_and_score(tokens, lengths, examples, g, step, graph_scores)

  def _decode_and_score(self, tokens, lengths, examples, g: int, step: int, graph_scores=None):
    """Detokenizes rows [N, T] up to their lengths and scores them: (rewards [N], comps [N, K], batch)."""
    n = tokens.shape[0]
    ids = [tokens[i, :max(0, min(int(lengths[i]), tokens.shape[1]))].tolist() for i in range(n)]
    texts = list(self.decode_fn(ids))
    precomputed = None
    if self.graph is not None and graph_scores is not None:
      graph_scores = np.asarray(graph_scores, np.float64).reshape(n, len(self.graph))
      precomputed = {name: graph_scores[:, j] for j, name in enumerate(self.graph.names)}
    out = self.pool.score(texts, examples, num_tokens=lengths, group_size=g, step=step, precomputed=precomputed)
    rewards = np.asarray(out.rewards, np.float32).reshape(n)
    comps = out.components_matrix().reshape(n, len(self.component_names))
    return rewards, comps, out

  def score(self, tokens: np.ndarray, lengths: np.ndarray, examples: Sequence[Mapping[str, Any]], *,
            step: int = 0, group_size: int | None = None, rollout: Any = None
            ) -> tuple[np.ndarray, np.ndarray, RewardBatch]:
    """Decodes and scores tokens [N, T] (lengths [N]) outside jit, without touching set_batch state.

    Returns (rewards [N] f32, components [N, K] f32, the pool's RewardBatch). The decoupled
    rollout modes call this from their scoring thread (trainer/rollouts.py). With reward models
    or judges, `rollout` (the device arrays of these rows) is scored by them on the mesh first
    (`graph_scores`).
    """
    g = self.group_size if group_size is None else int(group_size)
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(-1).astype(np.int64)
    n = tokens.shape[0]
    if len(examples) not in (n, n // max(g, 1)) or n % g:
      raise ValueError(f"reward_fn got {n} completions for {len(examples)} examples with group_size={g}; "
                       "set_batch needs one example per prompt (N // G) or per completion (N).")
    graph_scores = None
    if self.graph is not None:
      if rollout is None:
        raise ValueError("reward_fn.score: the spec has reward models or judges; pass rollout= (the rows' device "
                         "arrays) so that they score them on the mesh.")
      graph_scores = self.graph_scores(rollout.tokens, rollout.lengths, examples)
    return self._decode_and_score(tokens, lengths, examples, g, step, graph_scores)

  def graph_inputs(self, examples: Sequence[Mapping[str, Any]], num_prompts: int | None = None):
    """The step's reward inputs (the models' parameters and prompt pieces; GraphScorer.inputs), or
    None without reward models and judges."""
    return None if self.graph is None else self.graph.inputs(examples, num_prompts)

  def graph_scores(self, tokens, lengths, examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """[N, K_graph] host scores of device rows tokens [N, T], lengths [N] by the reward models and
    judges, in one compiled program on the graph's mesh (the decoupled modes' path)."""
    import jax

    from rljax import sharding as shd
    if self._graph_jit is None:
      def run(inputs, tokens, lengths):
        with shd.activate(self.graph.mesh):
          return self.graph.scores(inputs, tokens, lengths)
      self._graph_jit = jax.jit(run)
    n = tokens.shape[0]
    if self.graph.mesh is not None:   # rows may live on another mesh (the async generators')
      tokens, lengths = (jax.device_put(x, shd.batch_sharding(self.graph.mesh, x.ndim, n)) for x in (tokens, lengths))
    inputs = self.graph.inputs(examples, len(examples))
    return np.asarray(jax.device_get(self._graph_jit(inputs, tokens, lengths)), np.float32)

  # ---- per-shard callbacks: one round per step on this process --------------------------------

  def _local_devices(self) -> int:
    import jax
    me = jax.process_index()
    return sum(1 for d in np.asarray(self.mesh.devices).flat if d.process_index == me)

  def _shard_fn(self, n_total: int, width: int, *args) -> tuple[np.ndarray, np.ndarray]:
    """One device's callback: its rows' tokens (in pieces), lengths, (graph scores,) and global row indices."""
    pieces, lengths, extra, rows = self._unpack(args)
    rows = np.asarray(rows, np.int64).reshape(-1)
    n = rows.size
    flat = np.concatenate([np.asarray(p).reshape(-1) for p in pieces]) if pieces else np.zeros(0, np.int32)
    tokens = flat[:n * width].reshape(n, width)
    lengths = np.asarray(lengths).reshape(-1)
    with self._cv:
      r = self._round
      if r is None or r.closed:
        r = self._round = _Round(self._local_devices())
      r.arrivals.append((rows, tokens, lengths, extra))
      if len(r.arrivals) >= r.expected:
        r.closed = True
        self._cv.notify_all()
      deadline = time.monotonic() + self.gather_timeout_s
      while not r.closed and time.monotonic() < deadline:
        self._cv.wait(timeout=max(deadline - time.monotonic(), 0.0))
      if not r.closed:
        r.closed = True
        log.warning("reward callback: %d of this process's %d devices reached the scoring callback within "
                    "%.0f s; scoring those rows now (the others are scored when they arrive)",
                    len(r.arrivals), r.expected, self.gather_timeout_s)
      lead = not r.scoring
      r.scoring = True
    if lead:
      self._score_round(r, n_total)
    with self._cv:
      while not r.done:
        self._cv.wait()
      if r.error is not None:
        raise r.error
      rewards = np.asarray([r.results[int(i)][0] for i in rows], np.float32).reshape(n)
      comps = np.asarray([r.results[int(i)][1] for i in rows], np.float32).reshape(n, len(self.component_names))
    return rewards, comps

  def _score_round(self, r: _Round, n_total: int) -> None:
    """Scores the unique rows of a round once and wakes its devices.

    Rows that another round of this step scores, or scored, with the same token ids (replicas of a
    shard over other mesh axes, whose devices reached the callback more than gather_timeout_s
    apart) take that round's results: scoring them again would count them twice in the step's
    metrics, or, as a repeat of published rows, restart the step's metrics without the earlier
    rounds. A round claims its new rows under the lock before scoring, so it only ever waits for
    rounds that claimed earlier (no cycle).
    """
    try:
      with self._lock:
        step, g = self._step, self.group_size
      rows = np.concatenate([a[0] for a in r.arrivals])
      tokens = np.concatenate([a[1] for a in r.arrivals])
      lengths = np.concatenate([a[2] for a in r.arrivals])
      extra = None if self.graph is None else np.concatenate([np.asarray(a[3]) for a in r.arrivals])
      rows, first = np.unique(rows, return_index=True)   # replicas (other mesh axes) scored once
      tokens, lengths = tokens[first], lengths[first]
      extra = None if extra is None else extra[first]
      ids = [tokens[i, :max(0, min(int(lengths[i]), tokens.shape[1]))] for i in range(rows.size)]
      with self._cv:
        owners = self._claim(rows, ids, r)
        mine = np.asarray([owners[i] is r for i in rows.tolist()], bool)
        examples = self._lookup(rows[mine], n_total) if mine.any() else []
      results: dict[int, tuple[float, np.ndarray]] = {}
      if mine.any():
        new_rows = rows[mine]
        rewards, comps, out = self._score_rows(tokens[mine], lengths[mine], examples, step, g, new_rows,
                                               None if extra is None else extra[mine])
        results = {int(i): (float(rw), c) for i, rw, c in zip(new_rows, rewards, comps)}
      with self._cv:
        r.results = dict(results)   # the rows it claimed, for later rounds waiting on this one
        if mine.any():
          self._publish(out, new_rows, rewards, r.start)
        r.scored = True
        self._cv.notify_all()
        for i in rows.tolist():
          owner = owners[i]
          while not owner.scored:
            self._cv.wait()
          if owner.error is not None:
            raise owner.error
          results[i] = owner.results[i]
        r.results = results          # then every row it was given, its own and earlier rounds' claims
    except BaseException as e:  # noqa: BLE001 - re-raised in every waiting device's callback
      with self._cv:
        r.error = e
    finally:
      with self._cv:
        r.scored = r.done = True
        self._cv.notify_all()

  def _claim(self, rows: np.ndarray, ids: list[np.ndarray], r: _Round) -> dict[int, _Round]:
    """{row: the round that scores it}: a round of this step that claimed the row with these same
    token ids, else `r` (which claims it). A row claimed with other token ids means the step ran
    again without set_batch: a new step, whose rows all belong to `r` (caller holds the lock)."""
    if any(i in self._scored and not np.array_equal(self._scored[i][0], x) for i, x in zip(rows.tolist(), ids)):
      self._parts, self._timing, self._scored = [], None, {}
    owners = {}
    for i, x in zip(rows.tolist(), ids):
      if i not in self._scored:
        self._scored[i] = (x, r)
      owners[i] = self._scored[i][1]
    return owners

  # ---- jit side -----------------------------------------------------------------------------------

  def __call__(self, tokens, lengths, inputs=None):
    """Inside jit: (rewards [N] float32, components [N, K] float32) via io_callback.

    tokens [N, T] int, lengths [N] int. With a mesh of more than one device the rows are
    scored per device shard (module doc) and the results are sharded like the rows. `inputs`
    (`graph_inputs`): with reward models or judges, they score the rows here, in the program,
    and their [N, K_graph] scores go to the host with the tokens.
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    n, width = tokens.shape
    k = len(self.component_names)
    tokens = tokens.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    rows = jnp.arange(n, dtype=jnp.int32)
    extra = []
    if self.graph is not None:
      if inputs is None:
        raise ValueError("reward_fn: the spec has reward models or judges; pass inputs=reward_fn.graph_inputs(...)")
      extra = [jax.lax.stop_gradient(self.graph.scores(inputs, tokens, lengths)).astype(jnp.float32)]
    if self.mesh is None or self.mesh.size == 1:
      shapes = (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32))
      return io_callback(lambda *a: self._whole_fn(n, width, *a), shapes, *_pieces(tokens), lengths, *extra, rows,
                         ordered=False)
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rljax import sharding as shd
    g = max(self.group_size, 1)
    # Rows are sharded over the mesh axes that shard the prompts, so each shard is whole groups.
    axes = shd.logical_to_spec(("batch",), (n // g if n % g == 0 else n,), self.mesh)[0]
    if axes is not None and n % math.prod(self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)):
      axes = None

    def body(tok, lens, idx, *more):
      m = tok.shape[0]
      shapes = (jax.ShapeDtypeStruct((m,), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.float32))
      return io_callback(lambda *a: self._shard_fn(n, width, *a), shapes, *_pieces(tok), lens, *more, idx,
                         ordered=False)

    specs = (P(axes, None), P(axes), P(axes)) + (P(axes, None),) * len(extra)
    rewards, comps = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=(P(axes), P(axes, None)),
                                   check_vma=False)(tokens, lengths, rows, *extra)
    rewards = jax.lax.with_sharding_constraint(rewards, NamedSharding(self.mesh, P(axes)))
    comps = jax.lax.with_sharding_constraint(comps, NamedSharding(self.mesh, P(axes, None)))
    return rewards, comps

  def _whole_fn(self, n_total: int, width: int, *args):
    """The callback without a mesh: every row at once."""
    pieces, lengths, extra, rows = self._unpack(args)
    flat = np.concatenate([np.asarray(p).reshape(-1) for p in pieces]) if pieces else np.zeros(0, np.int32)
    tokens = flat[:n_total * width].reshape(n_total, width)
    return self.host_fn(tokens, lengths, rows, n_total, extra)

  def _unpack(self, args):
    """(token pieces, lengths, graph scores or None, rows) of a callback's arguments."""
    if self.graph is None:
      *pieces, lengths, rows = args
      return pieces, lengths, None, rows
    *pieces, lengths, extra, rows = args
    return pieces, lengths, np.asarray(extra), rows

  # ---- results --------------------------------------------------------------------------------------

  def last_batch(self) -> RewardBatch | None:
    """The RewardBatch of the rows this process scored in the last step (every callback round of
    it, rows in order; None before the first)."""
    with self._lock:
      return summaries.merge_batches(self._parts)[0] if self._parts else None

  def last_rows(self) -> np.ndarray | None:
    """The global row indices this process scored in the last step (sorted)."""
    with self._lock:
      return summaries.merge_batches(self._parts)[1].copy() if self._parts else None

  def last_rounds(self) -> int:
    """How many scoring calls the last step took on this process (more than one when its devices
    reached the callback more than gather_timeout_s apart)."""
    with self._lock:
      return len(self._parts)

  def last_metrics(self) -> dict[str, float]:
    """The pool's metrics of the last step, over every row this process scored in it ({} before the first)."""
    with self._lock:
      return dict(summaries.merge_batches(self._parts)[0].metrics) if self._parts else {}

  def global_metrics(self) -> dict[str, float]:
    """`last_metrics` combined over every process (a host all-gather: call it on every process).

    reward/mean, /std, /min, /max are exact over all rows; counts (verifier/timeouts, ...)
    are summed; verifier/seconds is the slowest process's; other means are weighted by the rows
    each process's figure is over (a component's scored rows, a source's rows, else all). Adds
    verifier/items (rows scored, all processes) and verifier/scoring_processes (processes that
    scored at least one row). Every callback round of the step counts (rljax/rewards/summaries.py).
    """
    import jax
    with self._lock:
      mine = summaries.merge([summaries.summary(b, r) for b, _, r in self._parts])
    if jax.process_count() == 1:
      parts = [mine]
    else:
      from rljax.sharding import allgather_objects
      parts = allgather_objects(mine)
    return combine_process_metrics(parts)

  def last_timing(self) -> dict[str, float] | None:
    """time.perf_counter() at the start and end of the last step's scoring (first arrival to the
    last round's scores)."""
    with self._lock:
      return dict(self._timing) if self._timing else None


def _pieces(tokens):
  """tokens [n, T] int32 as flat pieces of at most _PIECE_BYTES each (module doc)."""
  import jax.numpy as jnp
  flat = tokens.reshape(-1)
  per = _PIECE_BYTES // 4
  if flat.size <= per:
    return [flat]
  count = math.ceil(flat.size / per)
  flat = jnp.pad(flat, (0, count * per - flat.size))
  return [flat[i * per:(i + 1) * per] for i in range(count)]


def make_reward_fn(pool: RewardPool, decode_fn: Callable[[list[list[int]]], Sequence[str]], *,
                   group_size: int = 1, mesh: Any = None,
                   gather_timeout_s: float = DEFAULT_GATHER_TIMEOUT_S, graph: Any = None) -> RewardFn:
  """The io_callback reward function of `pool` (see the module doc); `graph`: the spec's reward
  models and judges (rljax/rewards/reward_models.py GraphScorer)."""
  return RewardFn(pool, decode_fn, group_size=group_size, mesh=mesh, gather_timeout_s=gather_timeout_s, graph=graph)
