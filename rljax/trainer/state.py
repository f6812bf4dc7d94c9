"""The train state: everything a step reads and writes, as one pytree."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TrainState:
  """Parameters, optimizer state and counters of a run.

  params: fp32 master weights (a plain pytree); opt_state: optax state;
  ref_params: frozen reference weights, or None when the KL coefficient is 0 (no copy kept);
  rng: raw PRNG key data [2] uint32 (raw so orbax can save it); step: rollout steps done.
  Updates skipped for non-finite gradients are counted in the optimizer state
  (`optax.apply_if_finite`; read them with `rljax.trainer.optim.skip_counts`).
  """
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  ref_params: Any = None

  @classmethod
  def create(cls, params, optimizer, seed: int, ref_params=None) -> "TrainState":
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
               rng=jax.random.key_data(jax.random.key(seed)), ref_params=ref_params)

  def next_rng(self) -> tuple["TrainState", jax.Array]:
    """Splits the stored key: returns the state with the new key and a key for this step."""
    key, sub = jax.random.split(jax.random.wrap_key_data(self.rng))
    return self.replace(rng=jax.random.key_data(key)), sub
