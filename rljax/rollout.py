"""The typed rollout that flows through a training step, and the protocol of whatever makes one.

Every rollout mode (the single-turn sampler, the multi-turn tool engine, the partial pool) is a
producer: `generate(params, key, prompt_ids, prompt_mask) -> Rollout`. The host scores the
rollout (`with_rewards`), and the update takes the scored rollout. Rows are prompt-major: row r
belongs to prompt r // G, so contiguous chunks of rows are whole groups.

Shapes: N = P * G rows, Lp = prompt width, T = completion width, K = reward components.
"""
from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Rollout:
  """The samples of one step.

  prompt_ids, prompt_mask: [N, Lp] int32 / bool, each prompt repeated for its G rows (left-padded).
  tokens: [N, T] int32 completion tokens (model tokens and, in multi-turn rollouts, tool tokens).
  mask: [N, T] bool, the tokens the loss trains on (the model's own tokens).
  context_mask: [N, T] bool, the completion tokens the model sees when the learner recomputes
    log-probs: model and tool tokens. Equal to `mask` for single-turn rollouts.
  logprobs: [N, T] float32, the sampler's log-probs of the tokens (0 where not sampled).
  entropy: [N, T] float32, the sampler's entropies.
  lengths: [N] int32, completion tokens per row: `mask.sum(-1)` for single-turn rollouts, the
    whole trajectory (model and tool tokens, `context_mask.sum(-1)`) for multi-turn ones.
  truncated: [N] bool, the row hit its length budget without a stop token.
  rewards: [N] float32, or None before scoring.
  components: [N, K] float32 per-component rewards, or None before scoring.
  group_size: G (static).
  """
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  mask: jax.Array
  context_mask: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  rewards: Any = None
  components: Any = None
  group_size: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  def with_rewards(self, rewards, components) -> "Rollout":
    """The scored rollout: rewards [N] and components [N, K], float32."""
    return self.replace(rewards=jnp.asarray(rewards, jnp.float32), components=jnp.asarray(components, jnp.float32))

  def rows(self, index) -> "Rollout":
    """The rollout restricted to `index` (an int array or a slice of rows)."""
    return jax.tree.map(lambda x: x[index], self)

  @classmethod
  def single_turn(cls, *, prompt_ids, prompt_mask, tokens, mask, logprobs, entropy, lengths, truncated,
                  group_size: int) -> "Rollout":
    """A rollout whose every completion token is the model's (context_mask = mask)."""
    return cls(prompt_ids=prompt_ids, prompt_mask=prompt_mask, tokens=tokens, mask=mask, context_mask=mask,
               logprobs=logprobs, entropy=entropy, lengths=lengths, truncated=truncated, group_size=group_size)


class RolloutProducer(Protocol):
  """Anything that turns prompts into a Rollout under the given parameters.

  prompt_ids, prompt_mask: [P, Lp]; key: a PRNG key. Returns a Rollout of P * G rows.
  """

  def __call__(self, params, key: jax.Array, prompt_ids: jax.Array, prompt_mask: jax.Array) -> Rollout:
    ...
