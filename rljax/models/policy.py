"""`Policy`: a model config, its parameters (a plain pytree) and optionally its tokenizer."""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rljax import sharding as shd
from rljax.models.config import ModelConfig
from rljax.models.outputs import ModelOutput
from rljax.models.transformer import KVCache, Transformer, positions_from_mask


def param_logical_axes(config: ModelConfig):
  """A pytree matching the params whose leaves are tuples of logical axis names."""
  abstract = jax.eval_shape(lambda: _init_boxed(config, jax.random.key(0)))
  specs = nn.get_partition_spec(abstract)
  return jax.tree.map(lambda s: tuple(s), specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def _init_boxed(config: ModelConfig, rng):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Transformer(config).init(rng, tokens, tokens)["params"]


def init_params(config: ModelConfig, rng: jax.Array):
  """Random parameters (normal(0.02) weights, unit norms), as a plain pytree."""
  return nn.unbox(_init_boxed(config, rng))


def param_shardings(config: ModelConfig, mesh, rules=shd.DEFAULT_RULES):
  """NamedShardings for every parameter on `mesh`."""
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  return shd.tree_shardings(param_logical_axes(config), shapes, mesh, rules)


@dataclasses.dataclass
class Policy:
  """A decoder LM ready to run: `logits = policy(input_ids, attention_mask)`.

  `params` is a plain nested dict of arrays (what optax and orbax see).
  """
  config: ModelConfig
  params: Any
  tokenizer: Any = None
  source: str | None = None

  @property
  def module(self) -> Transformer:
    return Transformer(self.config)

  def __call__(self, input_ids, attention_mask=None, positions=None):
    """input_ids [B, T] int -> logits [B, T, V] float32. Padding may be on either side."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask, bool)
    if positions is None:
      positions = positions_from_mask(mask)
    return _forward(self.config, self.params, input_ids, positions, mask)

  def with_params(self, params) -> "Policy":
    return dataclasses.replace(self, params=params)

  def shard(self, mesh, rules=shd.DEFAULT_RULES) -> "Policy":
    """Places the parameters on `mesh` by their logical axes."""
    return self.with_params(jax.device_put(self.params, param_shardings(self.config, mesh, rules)))

  def astype(self, param_dtype: str, dtype: str | None = None) -> "Policy":
    """Casts parameters (and optionally the compute dtype)."""
    cfg = self.config.replace(param_dtype=param_dtype, dtype=dtype or self.config.dtype)
    params = jax.tree.map(lambda x: x.astype(cfg.storage_dtype), self.params)
    return dataclasses.replace(self, config=cfg, params=params)


@jax.jit(static_argnums=0)
def _forward(config, params, tokens, positions, mask):
  return Transformer(config).apply({"params": params}, tokens, positions, mask).logits


def apply_model(config: ModelConfig, params, tokens, positions, token_mask=None, cache: KVCache | None = None,
                *, segment_ids=None, prefix_ids=None, return_hidden: bool = False, dropout_rng=None,
                routes=None) -> ModelOutput:
  """Functional forward used by the sampler and the learner (same code path): a `ModelOutput`
  (logits, or hidden states with `return_hidden`; the new cache; auxiliary losses; router statistics).

  segment_ids, prefix_ids: [B, T] int32 packed-row segments and the shared-prefix segment each token
  also sees, without a cache only (see `Transformer.__call__`).
  dropout_rng: a key for LoRA dropout (config.lora.dropout > 0), given by the learner's loss only.
  routes (mixture of experts): [B, T, L_moe, k] expert ids to replay (routing replay; `Transformer.__call__`).
  """
  rngs = None if dropout_rng is None else {"dropout": dropout_rng}
  return Transformer(config).apply({"params": params}, tokens, positions, token_mask, cache,
                                   segment_ids=segment_ids, prefix_ids=prefix_ids, return_hidden=return_hidden,
                                   rngs=rngs,
                                   routes=routes)


def output_kernel(config: ModelConfig, params) -> jax.Array:
  """[D, V] output projection in the compute dtype: `Transformer.output_kernel` of `params`."""
  return Transformer(config).apply({"params": params}, method=Transformer.output_kernel)
