"""The typed rollout that flows through a training step, what a producer reports beside it, and
the protocol every producer follows.

A producer turns prompts into samples under given parameters:

    rollout, info = producer(params, key, prompts)

`prompts` is a `PromptSource` (the trainer's prompt feed): a producer draws what it needs from it,
one batch for the single-turn sampler and the tool producer, as many as refill its pool for
the partial producer. `key` is this call's PRNG key. It returns the `Rollout` the update trains on
and a `RolloutInfo` with everything else it knows (which examples the rows answer, the data
position, its own metrics, the multi-turn trajectories): no producer keeps results on the side.

Shapes: N = P * G rows (prompt-major: row r belongs to prompt r // G), Lp = prompt width,
T = completion width, K = reward components.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from rljax import sharding as shd


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
  decode_step: [N] int32, the single-turn sampler's decode step that chose the row's last token
    (0: the first token, drawn from the prefill), or None from other producers; its max is the
    steps the decode loop ran (`sampler_metrics`).
  routes: [N, Lp + T, L_moe, k] the experts each token of [prompt | completion] was routed to in
    each routed layer when the sampler ran (mixture-of-experts models with routing replay on:
    the learner computes with them; ids >= E were not recorded and the learner routes those
    tokens itself), or None (dense models, replay off, producers that do not record).
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
  decode_step: Any = None
  routes: Any = None
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
                  group_size: int, decode_step=None, routes=None) -> "Rollout":
    """A rollout whose every completion token is the model's (context_mask = mask)."""
    return cls(prompt_ids=prompt_ids, prompt_mask=prompt_mask, tokens=tokens, mask=mask, context_mask=mask,
               logprobs=logprobs, entropy=entropy, lengths=lengths, truncated=truncated, decode_step=decode_step,
               routes=routes, group_size=group_size)


@dataclasses.dataclass
class RolloutInfo:
  """What a producer reports beside its `Rollout` (host values).

  examples: what each row is scored against: one example per prompt (row r answers
    examples[r // G]) or one per row (the tool producer adds each trajectory's tool counts).
  data_state: the data position just after the prompts this rollout answers (what a checkpoint of
    the step trained on it saves), or None when the prompts did not come from a feed.
  prompt_len: the prompt width Lp of the rollout.
  metrics: the producer's own figures, logged with the step (tools/*, rollout/*).
  age: calls of the producer since the oldest token of the rollout was drawn: 0 unless a producer
    carries samples over calls (partial rollouts); a runner turns it into the batch's staleness.
  trajectories: multi-turn rollouts: their `rljax.rollout.tools.Trajectories` on the host (per-row
    tool calls and errors, model and context masks), else None.
  """
  examples: list = dataclasses.field(default_factory=list)
  data_state: dict | None = None
  prompt_len: int = 0
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  age: int = 0
  trajectories: Any = None


@dataclasses.dataclass
class Prompts:
  """One prompt batch drawn from a feed: host examples and device arrays ids, mask [P, Lp]."""
  examples: list
  ids: jax.Array
  mask: jax.Array
  data_state: dict

  @property
  def width(self) -> int:
    return self.ids.shape[1]


class PromptSource(Protocol):
  """Where producers draw prompts (the trainer's `PromptFeed`)."""

  def next(self, sharding) -> Prompts:
    """The next batch as device arrays on `sharding`."""

  def next_host(self) -> tuple[Any, dict]:
    """The next batch as host arrays (a `PromptBatch`) and the data position just after it."""


class Producer(Protocol):
  """Anything that makes the samples of a step: the single-turn sampler
  (`rljax.rollout.sampler.SamplerProducer`), multi-turn tool use (`rljax.rollout.tools.ToolProducer`),
  the partial pool (`rljax.rollout.partial.PartialProducer`)."""

  def __call__(self, params, key: jax.Array, prompts: PromptSource) -> tuple[Rollout, RolloutInfo]:
    ...


def by_rows(mesh, tree):
  """NamedShardings that split every array of `tree` (arrays or ShapeDtypeStructs) by its rows."""
  return jax.tree.map(lambda x: shd.batch_sharding(mesh, x.ndim, x.shape[0]), tree)
