"""`rljax.generate`: sample completions from a `Policy` on the host's terms.

Prompts come as arrays or ragged lists of token ids; they are checked (empty prompts, ids
outside the vocabulary, prompts longer than the context), left-padded to a bucket width so nearby
lengths share one compiled program, and sampled by `rljax.rollout.sampler.sample`.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.padding import left_pad
from rljax.rollout.draw import SamplingParams, is_int
from rljax.rollout.sampler import SampleOutput, check_lengths, sample

_sample_jit = jax.jit(sample, static_argnames=("config", "sp", "eos_ids", "mesh", "rules"))

_BUCKET = 16


def generate(policy, prompt_ids, sp: SamplingParams, rng, prompt_mask=None, *, eos_ids: Sequence[int] | None = None,
             mesh: jax.sharding.Mesh | None = None) -> SampleOutput:
  """Samples `sp.num_samples` completions per prompt with a `Policy`.

  prompt_ids: [P, Lp] ints with `prompt_mask` [P, Lp] (None = every entry is a token), or a list
  of P token-id lists of any lengths (left-padded here). rng: a PRNG key or an int seed.
  eos_ids: default `default_stop_ids(policy)`: the model's EOS ids and the tokenizer's stop ids.
  mesh: default the mesh the parameters are sharded on, if any.

  Prompt widths are left-padded up to a multiple of 16 so nearby lengths share one compiled
  program (compiled once per config, sampling params, shapes and mesh). Returns a SampleOutput
  with [P * G, ...] rows; `out.grouped()` gives [P, G, ...] views, e.g. `out.grouped().tokens`.
  Raises ConfigError on empty prompts, out-of-vocabulary ids, or prompts too long for the context.
  """
  config: ModelConfig = policy.config
  if not isinstance(sp, SamplingParams):
    raise ConfigError(f"sp must be a SamplingParams, got {type(sp).__name__}.")
  sp.validate()
  ids, mask = _host_prompts(prompt_ids, prompt_mask, config.pad_token_id)
  n_real = mask.sum(-1)
  empty = np.flatnonzero(n_real == 0)
  if empty.size:
    raise ConfigError(f"prompt {int(empty[0])} is empty (no token has prompt_mask set); every prompt needs at "
                      "least one token, for example a BOS token or a chat template.")
  ctx = config.context_length
  longest = int(n_real.max())
  if longest > ctx:
    raise ConfigError(f"prompt {int(n_real.argmax())} has {longest} tokens, longer than the model's context "
                      f"(model.context_length={ctx}); truncate it.")
  bad = (ids < 0) | (ids >= config.vocab_size)
  if np.any(bad & mask):
    r, c = np.argwhere(bad & mask)[0]
    raise ConfigError(f"prompt {r} has token id {ids[r, c]} outside the vocabulary [0, {config.vocab_size}).")
  # Left-pad the real tokens to the bucket width, without passing the context.
  width = min(-(-longest // _BUCKET) * _BUCKET, max(longest, ctx - sp.max_new_tokens))
  ids, mask = left_pad([r[m] for r, m in zip(ids, mask)], config.pad_token_id, width, dtype=np.int64)
  check_lengths(config, sp, ids.shape[1])

  if eos_ids is None:
    eos_ids = default_stop_ids(policy)
  if mesh is None:
    mesh = _params_mesh(policy.params)
  if not isinstance(rng, jax.Array):
    rng = jax.random.key(int(rng))
  ids_j, mask_j = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  if mesh is not None:
    ids_j = jax.device_put(ids_j, shd.batch_sharding(mesh, 2, ids.shape[0]))
    mask_j = jax.device_put(mask_j, shd.batch_sharding(mesh, 2, ids.shape[0]))
  return _sample_jit(config, policy.params, ids_j, mask_j, sp, rng, tuple(int(i) for i in eos_ids), mesh=mesh)


def default_stop_ids(policy) -> tuple[int, ...]:
  """The model's `eos_token_ids` plus the tokenizer's stop ids (EOS and end-of-turn tokens)."""
  ids = set(policy.config.eos_token_ids)
  tok = policy.tokenizer
  if tok is not None:
    extra = getattr(tok, "stop_ids", None)
    if extra is None:
      extra = [getattr(tok, "eos_id", None), getattr(tok, "eos_token_id", None)]
    ids.update(int(i) for i in extra if is_int(i))
  return tuple(sorted(ids))


def _host_prompts(prompt_ids, prompt_mask, pad_id):
  """numpy ids [P, Lp] int64 and mask [P, Lp] bool from an array (+ mask) or ragged lists."""
  if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not np.isscalar(prompt_ids[0]):
    rows = [np.asarray(r, np.int64).reshape(-1) for r in prompt_ids]
    if prompt_mask is None and len({len(r) for r in rows}) > 1:
      return left_pad(rows, pad_id, dtype=np.int64)
  ids = np.asarray(prompt_ids)
  if ids.ndim == 1:
    ids = ids[None]
  if ids.ndim != 2 or ids.shape[0] < 1:
    raise ConfigError(f"prompt_ids has shape {ids.shape}; pass [P, Lp] token ids (P >= 1) or a list of lists.")
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ConfigError(f"prompt_ids has dtype {ids.dtype}; pass integer token ids.")
  ids = ids.astype(np.int64)
  if prompt_mask is None:
    mask = np.ones(ids.shape, bool)
  else:
    mask = np.asarray(prompt_mask).astype(bool).reshape(ids.shape[0], -1)
  if mask.shape != ids.shape:
    raise ConfigError(f"prompt_mask has shape {mask.shape} but prompt_ids has {ids.shape}.")
  return ids, mask


def _params_mesh(params) -> jax.sharding.Mesh | None:
  for leaf in jax.tree.leaves(params):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None
