"""The train state: everything a step reads and writes, as one pytree."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models import lora


@flax.struct.dataclass
class TrainState:
  """Parameters, optimizer state and counters of a run.

  params: fp32 master weights (a plain pytree); opt_state: optax state;
  ref_params: frozen reference weights, or None when the KL coefficient is 0 (no copy kept);
  frozen: with LoRA (`ModelConfig.lora`), the frozen base weights in their storage dtype; `params`
    and the optimizer state are then the adapters only, the model runs `lora.join(frozen, params)`
    (`model_params`), and the KL reference is the base alone (`reference_params`). Checkpoints
    leave it out (the run reloads it from config.model). None without LoRA.
  teacher: train.objective='distill': the frozen teacher's parameters (distill.teacher), sharded by its
    own logical axes like the reference; never optimised, left out of checkpoints (reloaded). Else None.
  rng: the run's base PRNG key as raw key data [2] uint32 (raw so orbax can save it), never
    advanced: every key a step uses derives from it and the step (`rollout_key`, `dropout_key`);
  step: rollout steps done.
  Updates skipped for non-finite gradients are counted in the optimizer state
  (`optax.apply_if_finite`; read them with `rljax.trainer.optim.skip_counts`).
  """
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  ref_params: Any = None
  frozen: Any = None
  teacher: Any = None

  @classmethod
  def create(cls, params, optimizer, seed: int, ref_params=None, frozen=None, teacher=None) -> "TrainState":
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
               rng=jax.random.key_data(jax.random.key(seed)), ref_params=ref_params, frozen=frozen, teacher=teacher)

  def saved(self) -> "TrainState":
    """What a checkpoint holds: the state without what the run reloads (the LoRA base, the teacher)."""
    return self.replace(frozen=None, teacher=None)

  def model_params(self, params=None):
    """The tree the model runs: `params` (default: the state's) joined with the frozen base under LoRA."""
    params = self.params if params is None else params
    return params if self.frozen is None else lora.join(self.frozen, params)

  def reference_params(self):
    """The KL reference: the stored copy, or under LoRA the base with the adapters off (no copy)."""
    return self.frozen if self.ref_params is None else self.ref_params


# The key streams of a run: fold_in(base, stream), then fold_in(., step).
_SAMPLE, _DROPOUT = 0, 1


def rollout_key(rng, step) -> jax.Array:
  """The sampling key of rollout step `step` (the 0-based index of the batch: the fused step's
  `state.step`, a decoupled runner's batch index) from the base key data `rng` [2] uint32. A
  function of the two alone: every mode, and a resumed run, draw batch k with the same key."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), _SAMPLE), step)


def dropout_key(rng, step) -> jax.Array:
  """The LoRA dropout key of the updates of rollout step `step` (each update folds in its index)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), _DROPOUT), step)
