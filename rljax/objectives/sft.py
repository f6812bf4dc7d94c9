"""The runner of train.objective='sft': a step takes the next batch of (prompt, target) rows from the
feed and runs the one update of trainer/step.py on it (cross-entropy of the target tokens). Nothing is
sampled or scored; the loop (checkpoints and exact resume, evaluation, metrics, export) is the RL run's.

The batch reaches the update as a `Rollout` of one row per prompt (group of one): prompt_ids /
prompt_mask [P, Lp], the target tokens [P, T] with `mask` the tokens trained on and `context_mask` the
tokens seen, no sampler log-probs, zero rewards.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from rljax import sharding as shd
from rljax.rollout.types import Rollout, RolloutInfo
from rljax.trainer import modes
from rljax.trainer.rollouts import RunContext, StepOutput
from rljax.trainer.setup import update_program
from rljax.trainer.state import TrainState


def sft_rollout(batch, mesh, pad_id: int = 0) -> Rollout:
  """An SftBatch (host arrays of this process's rows) as a Rollout of global arrays split by rows over `mesh`.
  With several processes every process pads its prompts to the widest one's width."""
  ids, pmask = np.asarray(batch.prompt_ids, np.int32), np.asarray(batch.prompt_mask, bool)
  if jax.process_count() > 1:
    width = max(shd.allgather_objects(ids.shape[1]))
    left = ((0, 0), (width - ids.shape[1], 0))
    ids, pmask = np.pad(ids, left, constant_values=pad_id), np.pad(pmask, left)
  tokens, mask, context = (np.asarray(x) for x in (batch.tokens, batch.mask, batch.context_mask))
  zeros = np.zeros(tokens.shape, np.float32)
  rows = tokens.shape[0]
  host = dict(prompt_ids=ids, prompt_mask=pmask, tokens=tokens.astype(np.int32), mask=mask, context_mask=context,
              logprobs=zeros, entropy=zeros, lengths=context.sum(-1).astype(np.int32),
              truncated=np.zeros((rows,), bool), rewards=np.zeros((rows,), np.float32),
              components=np.zeros((rows, 1), np.float32))
  total = rows * jax.process_count()
  arrays = {k: jax.make_array_from_process_local_data(shd.batch_sharding(mesh, v.ndim, total), v)
            for k, v in host.items()}
  return Rollout(**arrays, group_size=1)


class SftRunner:
  """`step(state, feed) -> (state, StepOutput)` for supervised fine-tuning (module docstring)."""
  mode = modes.Mode("sft", "rljax.objectives.sft:SftRunner", "supervised fine-tuning: one update per data batch",
                    max_staleness=0, default_staleness=0, exact_phases=True, multi_process=True)

  def __init__(self, ctx: RunContext, state: TrainState):
    del state
    self.ctx = ctx
    self.update = update_program(ctx.setup, ctx.mesh, ctx.state_shardings)
    self.counts = {"batches_trained": 0}

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    t0 = time.perf_counter()
    batch, data_state = feed.next_host()
    rollout = sft_rollout(batch, self.ctx.mesh, pad_id=self.ctx.pad_id)
    state, metrics = self.update(state, rollout)
    metrics = jax.device_get(metrics)
    seconds = time.perf_counter() - t0
    self.counts["batches_trained"] += 1
    width = rollout.prompt_ids.shape[1]
    info = RolloutInfo(examples=list(batch.examples), data_state=data_state, prompt_len=width)
    return state, StepOutput(metrics, {}, seconds, {"update": seconds}, width, data_state, info=info)

  def close(self) -> None:
    pass
