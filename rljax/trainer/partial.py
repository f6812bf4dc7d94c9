"""Partial rollouts, rollout.mode='partial' (docs/rollouts.md): one long completion does not hold a batch.

Generation runs on a pool of P * oversample prompt groups (G rows each) in compiled segments
(rljax/multiturn.py's `segment`). A round ends as soon as P groups have all their rows finished;
those P groups (oldest first) are scored and trained on, and the unfinished groups are carried
into the next round with their tokens and behaviour log-probs. Fresh prompts refill the pool.

Every row of the pool is prefilled at the start of a round (new groups too: G rows of one prompt
are prefilled G times here, unlike the fused sampler, because carried rows have their own
prefixes). A carried group resumes from its prefix: the next round prefills prompt + generated tokens
(`multiturn.reprefill`) under the newer parameters and decodes on, so a trajectory mixes policy
versions token by token. The update corrects for it like the other off-policy modes: lp_old is
recomputed (or, with rollout.proximal='sampler', the sampler's) and each token's truncated IS
weight uses the log-prob recorded when that token was drawn. A group whose first tokens are more
than rollout.max_staleness versions old when it would be trained is dropped and counted.

Checkpoints save the data position after the last prompts drawn; groups in flight at a save
(carried or waiting) are not restored on resume (counted in rollout/groups_dropped of the run
that drops them: they are simply never trained).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding as shd
from rljax.multiturn import FEED_BUCKET, TurnParams, new_state, reprefill, segment
from rljax.rollout import Rollout
from rljax.trainer.rollouts import Batch, Decoupled, RunContext, StepOutput, split_key
from rljax.trainer.state import TrainState


@dataclasses.dataclass
class Group:
  """One prompt and its G completions so far (host arrays)."""
  prompt: np.ndarray          # [n] the prompt's tokens
  example: dict
  version: int                # parameter version when its generation started
  tokens: np.ndarray          # [G, T] int32
  logprobs: np.ndarray        # [G, T] float32, recorded when each token was drawn
  entropy: np.ndarray         # [G, T] float32
  lengths: np.ndarray         # [G] int32
  done: np.ndarray            # [G] bool
  stopped: np.ndarray         # [G] bool: ended with a stop token
  rounds: int = 0             # rounds it has been generated in

  @property
  def complete(self) -> bool:
    return bool(self.done.all())


class PartialRollouts(Decoupled):
  """The runner of rollout.mode='partial' (see the module doc): its producer is the pool; scoring,
  the staleness bound, the update and the scheduler metrics are the shared decoupled machinery."""

  def __init__(self, ctx: RunContext, state: TrainState):
    super().__init__(ctx, state)
    self.p = ctx.spec.prompts
    self.pool_size = self.p * ctx.rollout_cfg.oversample
    self.g = ctx.spec.group
    self.t_new = ctx.spec.sampling.max_new_tokens
    self.width = ctx.max_prompt_tokens        # prompt width of every trained batch: one compiled update
    self.tp = TurnParams(segment_tokens=min(32, max(8, self.t_new // 8)))
    self.stop_ids = tuple(ctx.spec.sampling.stop_token_ids)
    self.pad = int(ctx.pad_id)
    self.pool: list[Group] = []
    self.waiting: list[Group] = []
    self.data_state: dict = {}
    self.counts.update({"groups_trained": 0, "groups_carried": 0, "groups_dropped": 0, "tokens_carried": 0})

  # ---- the pool ----------------------------------------------------------------------------

  def _new_group(self, ids, mask, example) -> Group:
    g, t = self.g, self.t_new
    return Group(prompt=np.asarray(ids)[np.asarray(mask, bool)], example=example, version=self.version,
                 tokens=np.full((g, t), self.pad, np.int32), logprobs=np.zeros((g, t), np.float32),
                 entropy=np.zeros((g, t), np.float32), lengths=np.zeros(g, np.int32), done=np.zeros(g, bool),
                 stopped=np.zeros(g, bool))

  def _fill(self, feed) -> None:
    while len(self.pool) < self.pool_size:
      if not self.waiting:
        batch, self.data_state = feed.next_host()
        self.waiting = [self._new_group(i, m, e) for i, m, e in zip(batch.prompt_ids, batch.prompt_mask,
                                                                     batch.examples)]
      self.pool.append(self.waiting.pop(0))

  def _round(self, params, key) -> int:
    """Generates on the pool until P groups are complete; returns the segments run."""
    c, sp, tp, g = self.ctx.spec.model, self.ctx.spec.sampling, self.tp, self.g
    b = self.pool_size * g
    rows = [(grp, r) for grp in self.pool for r in range(g)]
    hist = [np.concatenate([grp.prompt, grp.tokens[r, :grp.lengths[r]]]) for grp, r in rows]
    width = -(-max(len(h) for h in hist) // FEED_BUCKET) * FEED_BUCKET
    ids, mask = np.full((b, width), self.pad, np.int32), np.zeros((b, width), bool)
    for i, h in enumerate(hist):
      ids[i, width - len(h):], mask[i, width - len(h):] = h, True
    stack = lambda f: np.concatenate([f(grp) for grp in self.pool])
    lengths = stack(lambda x: x.lengths)
    filled = np.arange(self.t_new)[None, :] < lengths[:, None]
    put = lambda x: jax.device_put(jnp.asarray(x), shd.batch_sharding(self.ctx.mesh, np.ndim(x), b))
    state = new_state(c, sp, tp, b).replace(
        tokens=put(stack(lambda x: x.tokens)), logprobs=put(stack(lambda x: x.logprobs)),
        entropy=put(stack(lambda x: x.entropy)), n=put(lengths), mask=put(filled),
        done=put(stack(lambda x: x.done)), stopped=put(stack(lambda x: x.stopped)))
    state = reprefill(c, sp, tp, self.stop_ids, params, state, key, put(ids), put(mask), slots=self.t_new)
    segments = 0
    while True:
      state = segment(c, sp, tp, self.stop_ids, params, state, key)
      segments += 1
      done = np.asarray(jax.device_get(state.done)).reshape(self.pool_size, g)
      if done.all(1).sum() >= self.p or done.all():
        break
    tok, lp, ent, n, stopped, count = (np.asarray(x) for x in jax.device_get(
        (state.tokens, state.logprobs, state.entropy, state.n, state.stopped, state.count)))
    self.decode_steps = int(count)
    for k, grp in enumerate(self.pool):
      sl = slice(k * g, (k + 1) * g)
      grp.tokens, grp.logprobs, grp.entropy = tok[sl], lp[sl], ent[sl]
      grp.lengths, grp.done, grp.stopped = n[sl], done[k], stopped[sl]
      grp.rounds += 1
    return segments

  def _take(self) -> list[Group]:
    """The P oldest complete groups leave the pool; carried groups too stale to train are dropped."""
    picked = [grp for grp in self.pool if grp.complete][:self.p]
    rest = [grp for grp in self.pool if not any(grp is q for q in picked)]
    # After this update the parameters are version + 1: a carried group's oldest tokens would be
    # at least version + 1 - grp.version versions old when it is trained.
    keep = [grp for grp in rest if self.version + 1 - grp.version <= self.max_staleness]
    self.counts["groups_dropped"] += len(rest) - len(keep)
    carried = [grp for grp in keep if not grp.complete]
    self.counts["groups_carried"] += len(carried)
    self.counts["tokens_carried"] += int(sum(grp.lengths.sum() for grp in carried))
    self.pool = keep
    return picked

  def _rollout(self, groups: list[Group]) -> Rollout:
    """The Rollout of P groups: rows prompt-major, prompts left-padded to data.max_prompt_tokens."""
    g, w = self.g, self.width
    n_rows = len(groups) * g
    ids, mask = np.full((n_rows, w), self.pad, np.int32), np.zeros((n_rows, w), bool)
    for k, grp in enumerate(groups):
      ids[k * g:(k + 1) * g, w - len(grp.prompt):] = grp.prompt
      mask[k * g:(k + 1) * g, w - len(grp.prompt):] = True
    cat = lambda f: np.concatenate([f(grp) for grp in groups])
    lengths = cat(lambda x: x.lengths)
    model = np.arange(self.t_new)[None, :] < lengths[:, None]
    rollout = Rollout.single_turn(
        prompt_ids=ids, prompt_mask=mask, tokens=cat(lambda x: x.tokens), mask=model,
        logprobs=np.where(model, cat(lambda x: x.logprobs), 0.0).astype(np.float32),
        entropy=np.where(model, cat(lambda x: x.entropy), 0.0).astype(np.float32),
        lengths=lengths.astype(np.int32), truncated=(lengths == self.t_new) & ~cat(lambda x: x.stopped),
        group_size=g)
    return jax.device_put(rollout, jax.tree.map(lambda x: shd.batch_sharding(self.ctx.mesh, x.ndim, x.shape[0]),
                                                rollout))

  # ---- the step ----------------------------------------------------------------------------

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    t0 = time.perf_counter()
    self._fill(feed)
    self.rng, key = split_key(self.rng)
    segments = self._round(state.model_params(), key)
    groups = self._take()
    t1 = time.perf_counter()
    rollout = self._rollout(groups)
    # The batch is as old as its oldest group: that is the version the staleness bound checks.
    item = Batch(index=self.next_index, version=min(grp.version for grp in groups),
                 examples=[grp.example for grp in groups], data_state=self.data_state, prompt_len=self.width,
                 rollout=rollout, tokens=np.asarray(rollout.tokens), lengths=np.asarray(rollout.lengths))
    self.next_index += 1
    self.counts["batches_generated"] += 1
    self.score(item)
    t2 = time.perf_counter()
    state, metrics, staleness = self.train(state, item, rollout)
    t3 = time.perf_counter()
    self.counts["groups_trained"] += len(groups)
    item.extra = {
        "rollout/segments": float(segments),
        "rollout/decode_steps": float(self.decode_steps),     # tokens drawn per row this round, at most
        "rollout/groups_carried": float(sum(not grp.complete for grp in self.pool)),
        "rollout/groups_waiting": float(len(self.waiting)),
        "rollout/rounds_mean": float(np.mean([grp.rounds for grp in groups])),
        "rollout/groups_dropped_total": float(self.counts["groups_dropped"]),
        "rollout/tokens_carried_total": float(self.counts["tokens_carried"]),
    }
    phases = {"sample": t1 - t0, "score": t2 - t1, "update": t3 - t2}
    return state, self.output(item, metrics, t3 - t0, phases, staleness, len(self.waiting))

  def close(self) -> None:
    pass
