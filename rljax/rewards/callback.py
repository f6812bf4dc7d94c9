"""The bridge from a jitted training step to the reward pool (jax.experimental.io_callback).

    reward_fn = make_reward_fn(pool, tokenizer.batch_decode, group_size=G)
    reward_fn.set_batch(examples, step=step)          # host, before the jitted step
    ...inside jit:
    rewards, components = reward_fn(tokens, lengths)  # [N, T] int32, [N] int32 -> [N] f32, [N, K] f32
    ...after the step, on the host:
    reward_fn.last_metrics()                          # the pool's metrics of that batch

The callback receives the whole (gathered) batch once, decodes token ids to strings with
`decode_fn(list_of_token_id_lists) -> list[str]`, and scores them with `num_tokens=lengths`.
Its results come back on one device; pass `sharding=` (a NamedSharding of the batch axis)
or give the jit out_shardings to have them sharded.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rljax.rewards.compose import RewardBatch
from rljax.rewards.pool import RewardPool


class RewardFn:
  """Host state plus the jit-side call of the reward callback (see the module doc)."""

  def __init__(self, pool: RewardPool, decode_fn: Callable[[list[list[int]]], Sequence[str]], *,
               group_size: int = 1, sharding: Any = None):
    self.pool = pool
    self.decode_fn = decode_fn
    self.group_size = int(group_size)
    self.sharding = sharding
    self.component_names = list(pool.component_names)
    self._lock = threading.Lock()
    self._examples: list[Mapping[str, Any]] | None = None
    self._step = 0
    self._last: RewardBatch | None = None
    self._timing: dict[str, float] | None = None

  def set_batch(self, examples: Sequence[Mapping[str, Any]], step: int = 0, group_size: int | None = None) -> None:
    """The examples of the next call: one per prompt or one per completion (prompt-major)."""
    with self._lock:
      self._examples = list(examples)
      self._step = int(step)
      if group_size is not None:
        self.group_size = int(group_size)

  def host_fn(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decodes and scores a batch on the host; returns (rewards [N] f32, components [N, K] f32)."""
    start = time.perf_counter()
    with self._lock:
      examples, step, g = self._examples, self._step, self.group_size
    if examples is None:
      raise RuntimeError("reward_fn.set_batch(examples, step) must be called before the jitted step.")
    rewards, comps, out = self.score(tokens, lengths, examples, step=step, group_size=g)
    with self._lock:
      self._last = out
      self._timing = {"start": start, "end": time.perf_counter()}
    return rewards, comps

  def score(self, tokens: np.ndarray, lengths: np.ndarray, examples: Sequence[Mapping[str, Any]], *,
            step: int = 0, group_size: int | None = None) -> tuple[np.ndarray, np.ndarray, RewardBatch]:
    """Decodes and scores tokens [N, T] (lengths [N]) outside jit, without touching set_batch state.

    Returns (rewards [N] f32, components [N, K] f32, the pool's RewardBatch). The decoupled
    rollout modes call this from their scoring thread (trainer/rollouts.py).
    """
    g = self.group_size if group_size is None else int(group_size)
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(-1).astype(np.int64)
    n = tokens.shape[0]
    if len(examples) not in (n, n // max(g, 1)) or n % g:
      raise ValueError(f"reward_fn got {n} completions for {len(examples)} examples with group_size={g}; "
                       "set_batch needs one example per prompt (N // G) or per completion (N).")
    ids = [tokens[i, :max(0, min(int(lengths[i]), tokens.shape[1]))].tolist() for i in range(n)]
    texts = list(self.decode_fn(ids))
    out = self.pool.score(texts, examples, num_tokens=lengths, group_size=g, step=step)
    rewards = np.asarray(out.rewards, np.float32).reshape(n)
    comps = out.components_matrix().reshape(n, len(self.component_names))
    return rewards, comps, out

  def __call__(self, tokens, lengths):
    """Inside jit: (rewards [N] float32, components [N, K] float32) via io_callback."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    n = tokens.shape[0]
    shapes = (jax.ShapeDtypeStruct((n,), jnp.float32),
              jax.ShapeDtypeStruct((n, len(self.component_names)), jnp.float32))
    rewards, comps = io_callback(self.host_fn, shapes, tokens, lengths, ordered=False)
    if self.sharding is not None:
      from jax.sharding import NamedSharding, PartitionSpec
      rewards = jax.lax.with_sharding_constraint(rewards, self.sharding)
      spec = tuple(self.sharding.spec) + (None,) * (2 - len(tuple(self.sharding.spec)))
      comps = jax.lax.with_sharding_constraint(comps, NamedSharding(self.sharding.mesh, PartitionSpec(*spec[:2])))
    return rewards, comps

  def last_batch(self) -> RewardBatch | None:
    """The RewardBatch of the last callback (None before the first)."""
    with self._lock:
      return self._last

  def last_metrics(self) -> dict[str, float]:
    """The pool's metrics of the last callback ({} before the first)."""
    with self._lock:
      return dict(self._last.metrics) if self._last is not None else {}

  def last_timing(self) -> dict[str, float] | None:
    """time.perf_counter() at the start and end of the last callback."""
    with self._lock:
      return dict(self._timing) if self._timing else None


def make_reward_fn(pool: RewardPool, decode_fn: Callable[[list[list[int]]], Sequence[str]], *,
                   group_size: int = 1, sharding: Any = None) -> RewardFn:
  """The io_callback reward function of `pool` (see the module doc)."""
  return RewardFn(pool, decode_fn, group_size=group_size, sharding=sharding)
