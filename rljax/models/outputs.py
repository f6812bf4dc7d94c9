"""What the model's forward returns: `ModelOutput`, and the per-layer statistics behind it."""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


def no_stats() -> dict[str, dict[str, jax.Array]]:
  """A feed-forward block's statistics when it has none (dense MLPs): no auxiliary loss, no router."""
  return {"aux_losses": {}, "router": {}}


@flax.struct.dataclass
class ModelOutput:
  """One forward's results (a pytree: it passes through jit, scan and grad).

  logits: [B, T, V] float32 (soft-capped when the model says so), or None when the final hidden
    states were asked for instead (`return_hidden`, for chunked log-probs);
  hidden: [B, T, D] final-normed hidden states in the compute dtype, or None;
  cache: the updated KV cache, or None without one;
  aux_losses: name -> [] float32, auxiliary losses summed over layers and already weighted by the
    model config's coefficients (e.g. a mixture of experts' load balancing); the learner adds their
    sum to its loss. Empty for dense models;
  router: name -> [L, ...] per-layer router statistics (e.g. chosen experts). Empty for dense models.
  """
  logits: Any = None
  hidden: Any = None
  cache: Any = None
  aux_losses: dict = dataclasses.field(default_factory=dict)
  router: dict = dataclasses.field(default_factory=dict)

  @property
  def aux_loss(self) -> jax.Array:
    """[] float32: the sum of `aux_losses` (0 without any)."""
    return sum(self.aux_losses.values(), jnp.zeros((), jnp.float32))


def collect_stats(runs: list[dict[str, dict[str, jax.Array]]]) -> tuple[dict, dict]:
  """The statistics of the runs of layers, in model order, each stacked over its layers ([n, ...]
  leaves) -> (aux_losses summed over every layer, router statistics concatenated over the layers
  that have them [L_routed, ...])."""
  aux: dict = {}
  router: dict = {}
  for stacked in runs:
    for name, value in stacked.get("aux_losses", {}).items():
      aux[name] = aux.get(name, 0.0) + jnp.sum(value.astype(jnp.float32))
    for name, value in stacked.get("router", {}).items():
      router.setdefault(name, []).append(value)
  return aux, {name: v[0] if len(v) == 1 else jnp.concatenate(v, axis=0) for name, v in router.items()}
