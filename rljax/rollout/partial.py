"""Partial rollouts (rollout.mode='partial', docs/rollouts.md): one long completion does not hold
a batch.

`PartialProducer` keeps a pool of P * oversample prompt groups (G rows each) and decodes it in
segments (rljax/rollout/segments.py). A call ends as soon as P groups have all their rows
finished; those P groups (oldest first) are the call's rollout, and the unfinished groups are
carried into the next call with their tokens and behaviour log-probs. Fresh prompts from the feed
refill the pool.

Every row of the pool is prefilled at the start of a call (new groups too: G rows of one prompt
are prefilled G times here, unlike the single-turn sampler, because carried rows have their own
histories). A carried group resumes from its history (`segments.restart`) under the newer
parameters and decodes on, so a trajectory mixes policy versions token by token. The update
corrects for it like the other off-policy modes: lp_old is recomputed (or, with
rollout.proximal='sampler', the sampler's) and each token's truncated IS weight uses the log-prob
recorded when that token was drawn.

The producer counts its calls: a group is as old as the calls since it was drawn from the feed,
and the rollout reports its oldest group's age (`RolloutInfo.age`). One update follows each
call, so a group `max_staleness` calls old would be trained that many versions late: a carried
group that would be older than that when trained is dropped and counted.

Groups in flight (carried or waiting) are not saved in checkpoints: a resumed run starts with
an empty pool (counted in groups_dropped of the run that drops them: they are simply never
trained).

In a multi-process run each process keeps the pool of its own prompts (P / processes groups of
the batch, times `oversample`), on the rows its devices hold; side by side, in process order, the
pools are the one pool of a one-process run (the data is dealt in blocks of a process's share).
The segments are programs of the whole mesh, and the rules are the one-process rules over that
joint pool: the processes decode on until P groups are complete over all of them (agreed after
each segment), the step trains the first P complete groups in joint pool order, and those move
between processes (one host all-gather) so that each process trains its block of them, P /
processes groups, on the rows its devices hold. Groups not trained stay in their own process's
pool. At max_staleness=0, where no group outlives its call, a multi-process run therefore trains
a one-process run's batches; with carried groups each process refills its own pool from its own
prompts, so the joint pool's order departs from a one-process run's after the first call.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.rollout import segments
from rljax.rollout.sampler import SegmentCopy
from rljax.rollout.types import Rollout, RolloutInfo, by_rows


@dataclasses.dataclass
class Group:
  """One prompt and its G completions so far (host arrays)."""
  prompt: np.ndarray          # [n] the prompt's tokens
  example: dict
  born: int                   # the producer call that drew it from the feed
  tokens: np.ndarray          # [G, T] int32
  logprobs: np.ndarray        # [G, T] float32, recorded when each token was drawn
  entropy: np.ndarray         # [G, T] float32
  lengths: np.ndarray         # [G] int32
  done: np.ndarray            # [G] bool
  stopped: np.ndarray         # [G] bool: ended with a stop token
  rounds: int = 0             # calls it has been generated in

  @property
  def complete(self) -> bool:
    return bool(self.done.all())


class PartialProducer:
  """The pool of partial rollouts as a producer (`rljax.rollout.types.Producer`; module doc).

  spec: the StepSpec (model, sampling, prompts P, group G); oversample: pool size in units of P;
  width: the prompt width of every rollout (data.max_prompt_tokens: one compiled update);
  max_staleness: the oldest a group may be when trained; pad_id: the tokenizer's pad id.
  `counts` accumulates groups_trained / carried / dropped and tokens_carried over the calls.
  """

  def __init__(self, spec, mesh: jax.sharding.Mesh, *, oversample: int, width: int, max_staleness: int,
               pad_id: int = 0):
    self.spec, self.mesh = spec, mesh
    self.processes = jax.process_count()
    if spec.prompts % self.processes:
      raise ConfigError(f"config.train.prompts_per_step={spec.prompts} must be divisible by the number of processes "
                        f"({self.processes}) in rollout.mode='partial': each process trains its share of the groups.")
    self.p, self.g = spec.prompts // self.processes, spec.group      # this process's groups per call
    self.pool_size = self.p * oversample                              # this process's pool
    self.t_new = spec.sampling.max_new_tokens
    self.width, self.max_staleness, self.pad = width, max_staleness, int(pad_id)
    self.seg = segments.SegmentParams(segment_tokens=min(32, max(8, self.t_new // 8)))
    self.stop_ids = tuple(spec.sampling.stop_token_ids)
    self.calls = 0
    self.decode_copy = SegmentCopy(spec.model, mesh)   # the sampler's copy, made once per call
    self.pool: list[Group] = []
    self.waiting: list[Group] = []
    self.data_state: dict = {}
    self.counts = {"groups_trained": 0, "groups_carried": 0, "groups_dropped": 0, "tokens_carried": 0}

  def __call__(self, params, key, prompts) -> tuple[Rollout, RolloutInfo]:
    self._fill(prompts)
    segments_run, decode_steps = self._round(self.decode_copy(params), key)
    picked, joint = self._take()
    groups = self._share(picked, joint)
    me = jax.process_index()
    moved = sum(proc != me for proc, _ in joint[me * self.p:(me + 1) * self.p])
    self.counts["groups_trained"] += len(groups)
    here = {"age": self.calls - min(grp.born for grp in groups),
            "groups_carried": sum(not grp.complete for grp in self.pool), "groups_waiting": len(self.waiting),
            "rounds": sum(grp.rounds for grp in groups), "groups_dropped_total": self.counts["groups_dropped"],
            "tokens_carried_total": self.counts["tokens_carried"], "groups_moved": moved}
    every = shd.allgather_objects(here)          # each process's pool; the metrics cover all of them
    total = {k: sum(e[k] for e in every) for k in here}
    age = max(e["age"] for e in every)
    metrics = {
        "rollout/segments": float(segments_run),
        "rollout/decode_steps": float(decode_steps),     # tokens drawn per row this call, at most
        "rollout/groups_carried": float(total["groups_carried"]),
        "rollout/groups_waiting": float(total["groups_waiting"]),
        "rollout/rounds_mean": total["rounds"] / (self.p * self.processes),
        "rollout/groups_dropped_total": float(total["groups_dropped_total"]),
        "rollout/tokens_carried_total": float(total["tokens_carried_total"]),
        "rollout/groups_moved": float(total["groups_moved"]),   # trained by another process than drew them
    }
    self.calls += 1
    return self._rollout(groups), RolloutInfo(examples=[grp.example for grp in groups], data_state=self.data_state,
                                              prompt_len=self.width, metrics=metrics, age=age)

  def _new_group(self, ids, mask, example) -> Group:
    g, t = self.g, self.t_new
    return Group(prompt=np.asarray(ids)[np.asarray(mask, bool)], example=example, born=self.calls,
                 tokens=np.full((g, t), self.pad, np.int32), logprobs=np.zeros((g, t), np.float32),
                 entropy=np.zeros((g, t), np.float32), lengths=np.zeros(g, np.int32), done=np.zeros(g, bool),
                 stopped=np.zeros(g, bool))

  def _fill(self, prompts) -> None:
    while len(self.pool) < self.pool_size:
      if not self.waiting:
        batch, self.data_state = prompts.next_host()
        self.waiting = [self._new_group(i, m, e) for i, m, e in zip(batch.prompt_ids, batch.prompt_mask,
                                                                     batch.examples)]
      self.pool.append(self.waiting.pop(0))

  def _round(self, params, key) -> tuple[int, int]:
    """Generates on the pool until P groups are complete; returns (segments run, decode steps)."""
    c, sp, g = self.spec.model, self.spec.sampling, self.g
    b = self.pool_size * g                       # this process's rows
    hist = [np.concatenate([grp.prompt, grp.tokens[r, :grp.lengths[r]]]) for grp in self.pool for r in range(g)]
    b_all = b * self.processes
    rows = shd.ProcessRows(shd.batch_sharding(self.mesh, 1, b_all), b_all)
    width = rows.max(max(len(h) for h in hist))          # one width for every process's rows
    width = -(-width // segments.FEED_BUCKET) * segments.FEED_BUCKET
    ids, mask = np.full((b, width), self.pad, np.int32), np.zeros((b, width), bool)
    for i, h in enumerate(hist):
      ids[i, width - len(h):], mask[i, width - len(h):] = h, True
    stack = lambda f: np.concatenate([f(grp) for grp in self.pool])
    lengths = stack(lambda x: x.lengths)
    filled = np.arange(self.t_new)[None, :] < lengths[:, None]
    put = lambda x: shd.rows_from_processes(np.asarray(x), shd.batch_sharding(self.mesh, np.ndim(x), b_all), b_all)
    state = segments.SegmentState.init(c, b, self.t_new).replace(
        tokens=put(stack(lambda x: x.tokens)), logprobs=put(stack(lambda x: x.logprobs)),
        entropy=put(stack(lambda x: x.entropy)), n=put(lengths), mask=put(filled),
        done=put(stack(lambda x: x.done)), stopped=put(stack(lambda x: x.stopped)))
    static = (c, sp, self.seg, self.stop_ids)
    state = segments.restart(*static, params, state, key, put(ids), put(mask), slots=self.t_new)
    run = 0
    while True:
      state = segments.segment(*static, params, state, key)
      run += 1
      done = rows.local(state.done).reshape(self.pool_size, g)
      joint = rows.sum({"complete": int(done.all(1).sum()), "open": int(not done.all())})
      if joint["complete"] >= self.p * self.processes or not joint["open"]:   # P groups over all processes
        break
    tok, lp, ent, n, stopped = rows.local(state.tokens, state.logprobs, state.entropy, state.n, state.stopped)
    count = shd.local_value(state.count)
    for k, grp in enumerate(self.pool):
      sl = slice(k * g, (k + 1) * g)
      grp.tokens, grp.logprobs, grp.entropy = tok[sl], lp[sl], ent[sl]
      grp.lengths, grp.done, grp.stopped = n[sl], done[k], stopped[sl]
      grp.rounds += 1
    return run, int(count)

  def _take(self) -> tuple[list[Group], list[tuple[int, int]]]:
    """The first P complete groups of the joint pool (the processes' pools in process order) leave
    the pools; carried groups too old to train are dropped. Returns (this process's picked groups,
    (process, pool position) of all P picked groups in joint order)."""
    complete = [grp.complete for grp in self.pool]
    every = shd.allgather_objects(complete)   # [complete] in a one-process run
    joint = [(proc, i) for proc, flags in enumerate(every) for i, flag in enumerate(flags) if flag]
    joint = joint[:self.p * self.processes]
    me = jax.process_index()
    picked = [self.pool[i] for proc, i in joint if proc == me]
    rest = [grp for grp in self.pool if not any(grp is q for q in picked)]
    # One update follows this call: a carried group would be at least calls + 1 - born versions old
    # when it is trained.
    keep = [grp for grp in rest if self.calls + 1 - grp.born <= self.max_staleness]
    self.counts["groups_dropped"] += len(rest) - len(keep)
    carried = [grp for grp in keep if not grp.complete]
    self.counts["groups_carried"] += len(carried)
    self.counts["tokens_carried"] += int(sum(grp.lengths.sum() for grp in carried))
    self.pool = keep
    return picked, joint

  def _share(self, picked: list[Group], joint: list[tuple[int, int]]) -> list[Group]:
    """This process's block of the P picked groups (joint order; the whole of them in a one-process
    run): groups picked from another process's pool come over in one host all-gather."""
    if self.processes == 1:
      return picked
    me, total = jax.process_index(), len(joint)
    arrays = ("tokens", "logprobs", "entropy", "lengths", "done", "stopped")
    mine, template = {}, self._new_group(np.zeros(1, np.int32), np.ones(1, bool), {})
    for name in arrays:   # [total, ...] with this process's picks first, zeros after
      x = getattr(template, name)
      block = np.zeros((total, *x.shape), x.dtype)
      for k, grp in enumerate(picked):
        block[k] = getattr(grp, name)
      mine[name] = block
    gathered = jax.tree.map(np.asarray, multihost_utils.process_allgather(mine))   # one program for all six
    meta = shd.allgather_objects([{"prompt": grp.prompt.tolist(), "example": grp.example, "born": grp.born,
                                   "rounds": grp.rounds} for grp in picked])
    rank, seen = {}, [0] * self.processes   # (process, pool position) -> its rank among that process's picks
    for proc, i in joint:
      rank[(proc, i)], seen[proc] = seen[proc], seen[proc] + 1
    share = []
    for proc, i in joint[me * self.p:(me + 1) * self.p]:
      k = rank[(proc, i)]
      if proc == me:
        share.append(picked[k])
        continue
      m = meta[proc][k]
      share.append(Group(prompt=np.asarray(m["prompt"], np.int32), example=m["example"], born=m["born"],
                         rounds=m["rounds"], **{name: gathered[name][proc][k] for name in arrays}))
    return share

  def _rollout(self, groups: list[Group]) -> Rollout:
    """The Rollout of P groups: rows prompt-major, prompts left-padded to `width`, split by rows."""
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
    n = n_rows * self.processes
    return jax.tree.map(lambda x, s: shd.rows_from_processes(np.asarray(x), s, n), rollout,
                        by_rows(self.mesh, jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *np.shape(x)[1:]), x.dtype),
                                                        rollout)))
