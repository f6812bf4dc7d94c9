"""What the training loop does around its steps, as hooks with an `every`.

After step n (counted from 1) the loop calls `hook.fn(trainer, info)` for every hook with
`n % hook.every == 0`, in order: logging, then evaluation, then checkpointing (which keeps the
evaluation's metrics as the checkpoint's, for keep-best). `start` runs once before the first
step and `finish` once after the last.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass
class StepInfo:
  """One finished step as hooks see it."""
  step: int                        # steps done, counting from 1
  metrics: dict[str, float]        # the step's logged metrics
  last: bool                       # the run's last step
  eval_metrics: dict[str, Any] | None = None


@dataclasses.dataclass
class Hook:
  fn: Callable[[Any, StepInfo], None]
  every: int = 1
  start: Callable[[Any, Any], None] = lambda trainer, writer: None
  finish: Callable[[Any], None] = lambda trainer: None


class _Log:
  """metrics.jsonl, TensorBoard and the progress bar."""

  def __init__(self):
    self.writer = None
    self.progress = None

  def start(self, trainer, writer) -> None:
    from tqdm.auto import tqdm
    c = trainer.config
    self.writer = writer
    from rljax import progress
    self.progress = progress.track(tqdm(total=c.train.steps, initial=trainer.start_step, desc="train", unit="step",
                                        disable=not (c.output.progress and jax.process_index() == 0),
                                        dynamic_ncols=True))

  def __call__(self, trainer, info: StepInfo) -> None:
    m = info.metrics
    self.writer.write(info.step, m)
    self.progress.update(1)
    # sft scores nothing while training: its bar shows the targets' token-mean negative log-likelihood.
    first = {"reward": f"{m['reward/mean']:.3f}"} if "reward/mean" in m else {"nll": f"{m.get('nll', 0):.3f}"}
    self.progress.set_postfix({**first, "loss": f"{m.get('loss', 0):.4f}",
                               "len": f"{m.get('response_length_mean', 0):.0f}", "s": f"{m['time/step']:.1f}",
                               "mfu": f"{m.get('perf/mfu', 0):.1%}"})

  def finish(self, trainer) -> None:
    from rljax import progress
    progress.untrack(self.progress)
    self.progress.close()


class _Evaluate:
  """Held-out evaluation every config.eval.every steps (the run's end has its own)."""

  def __init__(self):
    self.writer = None

  def start(self, trainer, writer) -> None:
    self.writer = writer

  def __call__(self, trainer, info: StepInfo) -> None:
    if info.last:
      return
    info.eval_metrics = trainer.evaluate(f"step{info.step}")
    self.writer.write(info.step, {f"eval/{k}": v for k, v in info.eval_metrics.items() if isinstance(v, float)})


def _checkpoint(trainer, info: StepInfo) -> None:
  """Only a step whose update went through is a good checkpoint."""
  if info.metrics.get("skipped_consecutive", 0) == 0:
    trainer.save(info.eval_metrics)


def default_hooks(trainer) -> list[Hook]:
  c = trainer.config
  log_hook, eval_hook = _Log(), _Evaluate()
  hooks = [Hook(log_hook, 1, log_hook.start, log_hook.finish)]
  if c.eval.every and trainer.eval_data is not None:
    hooks.append(Hook(eval_hook, c.eval.every, eval_hook.start))
  if c.checkpoint.every:
    hooks.append(Hook(_checkpoint, c.checkpoint.every))
  return hooks
