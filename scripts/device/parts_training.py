"""Device check parts: one step on a sharded CPU mesh against the same step on the device, and a short
training run of the smoke recipe."""
from __future__ import annotations

import json
import math
import os
import time

import numpy as np
from checklib import (
  TINY_RANDOM,
  Context,
  Recorder,
  build_workload,
  finite,
  load_run_config,
  random_prompts,
  replicated_key,
  write_word_tokenizer,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _metric(metrics: dict, name: str) -> float:
  """A scalar metric by name, or by the name under which the update reduces it (`loss/mean`, ...)."""
  if name in metrics:
    return float(metrics[name])
  for key in sorted(metrics):
    if key.split("/")[0] == name:
      return float(metrics[key])
  raise KeyError(f"no metric {name!r} among {sorted(metrics)[:20]}")


def sharded_step(rec: Recorder, ctx: Context) -> None:
  """One sample + update of a tiny fp32 model on the default device (the GPU; a CPU device with
  --cpu) against the same step on a (data, fsdp, tensor) = (2, 2, 2) mesh of 8 CPU devices, same
  weights, prompts and key, matmuls at the highest precision. The sampled tokens must agree; the
  update then runs on the same scored rollout on both sides, and the loss, the gradient norm and
  the parameter update must agree to float32 reduction order (loss and grad norm 1e-4 relative,
  parameters 1e-3 of the update's size)."""
  import jax

  from rljax import sharding as shd
  jax.config.update("jax_default_matmul_precision", "highest")
  cpus = jax.devices("cpu")
  if len(cpus) < 8:
    rec.row("(2, 2, 2) CPU mesh vs one device", "skipped",
            note=f"needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), found {len(cpus)}")
    return
  overrides = dict(TINY_RANDOM, **{"model.dtype": "float32", "rl.kl_coef": 0.0, "train.prompts_per_step": 4,
                                   "sampling.num_samples": 4, "data.max_prompt_tokens": 8,
                                   "sampling.max_new_tokens": 8, "sampling.ignore_eos": True,
                                   "optim.learning_rate": 1e-3, "mesh.shape": (1, -1, 1)})
  cfg = load_run_config(overrides)
  one = jax.devices()[0]
  wa = build_workload(cfg, mesh=shd.make_mesh((1, 1, 1), devices=[one]))
  p0 = jax.device_get(wa.state.params)
  wb = build_workload(cfg, mesh=shd.make_mesh((2, 2, 2), devices=cpus[:8]), params=p0)
  ra = wa.generate(wa.state.model_params(), replicated_key(wa, 1), *random_prompts(wa, left_pad=True))
  rb = wb.generate(wb.state.model_params(), replicated_key(wb, 1), *random_prompts(wb, left_pad=True))
  ra, rb = jax.device_get(ra), jax.device_get(rb)
  same = float(np.mean(ra.tokens == rb.tokens))
  m = ra.mask & rb.mask
  lp_diff = float(np.abs(ra.logprobs - rb.logprobs)[m].max())
  where = f"{one.platform} ({one.device_kind}) vs 8 CPU devices"
  rec.row("sampler: tokens and log-probs", "ok" if same == 1.0 and lp_diff < 1e-4 else "fail",
          {"tokens_equal": same, "logprob_max_diff": lp_diff}, f"{where}; thresholds: all tokens, 1e-4")
  rewards = (ra.tokens.sum(-1) % 5 / 4.0).astype(np.float32)
  scored = ra.with_rewards(rewards, rewards[:, None])
  outs = []
  for w in (wa, wb):
    shardings = jax.tree.map(lambda x: x.sharding, w.inputs.rollout)
    state, metrics = w.update(w.state, jax.device_put(scored, shardings))
    outs.append((jax.device_get(state.params), {k: float(v) for k, v in jax.device_get(metrics).items()}))
  (pa, ma), (pb, mb) = outs
  close = lambda a, b: abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-6
  la, lb, ga, gb = _metric(ma, "loss"), _metric(mb, "loss"), _metric(ma, "grad_norm"), _metric(mb, "grad_norm")
  step = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(p0)))
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
  ok = close(la, lb) and close(ga, gb) and step > 0 and diff <= 1e-2 * step
  rec.row("learner: loss, grad norm, parameters", "ok" if ok else "fail",
          {"loss": la, "loss_abs_diff": abs(la - lb), "grad_norm": ga,
           "grad_norm_rel_diff": abs(ga - gb) / max(ga, 1e-12),
           "param_diff_over_update": diff / step if step else float("nan")},
          f"{where}; loss and grad norm within 1e-4 relative + 1e-6, parameters after one AdamW step within 1e-2 "
          "of the update (Adam's first step divides by |g|: near-zero gradients magnify reduction-order noise)")


def smoke_train(rec: Recorder, ctx: Context) -> None:
  """`rljax train` on the smoke recipe (a tiny random model learns to write vowels with GRPO) through
  the Trainer: data pipeline, reward pool, fused step, metrics and checkpoints, with a word-level
  tokenizer written here (the recipe's SmolLM2 tokenizer does not travel). On the GPU, 20 steps must
  lift the mean reward of the last 3 steps 0.1 above the first 3 (as tests/test_trainer.py asks on
  the CPU); --cpu runs 3 steps and checks only that they ran."""
  import jax

  from rljax.config_overrides import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  steps = int(ctx.options.get("smoke_steps", 3 if ctx.cpu else 20))
  tok = write_word_tokenizer(os.path.join(ctx.work_dir, "smoke-tokenizer"), 512)
  cfg = load_config_file(os.path.join(ROOT, "rljax", "configs", "smoke.py"))
  apply_overrides(cfg, [f"tokenizer={tok!r}", f"output.dir={os.path.join(ctx.work_dir, 'smoke-run')!r}",
                        f"train.steps={steps}", "output.progress=False"])
  t0 = time.perf_counter()
  summary = Trainer(cfg).run()
  wall = time.perf_counter() - t0
  with open(summary["metrics_file"], encoding="utf-8") as f:
    metrics = [json.loads(line) for line in f if line.strip()]
  rows = [m for m in metrics if "reward/mean" in m]
  rewards = [m["reward/mean"] for m in rows]
  step_s = [m["time/step"] for m in rows]
  first, last = float(np.mean(rewards[:3])), float(np.mean(rewards[-3:]))
  ran = len(rewards) == steps and all(finite(x) for x in rewards + step_s)
  learned = last > first + 0.1
  judged = steps >= 20
  values = {"steps": len(rewards), "reward_first3": first, "reward_last3": last,
            "first_step_s": step_s[0] if step_s else math.nan,
            "median_step_s": float(np.median(step_s[1:])) if len(step_s) > 1 else math.nan, "wall_s": wall,
            "platform": jax.devices()[0].platform}
  rec.row(f"smoke recipe, {steps} steps", "ok" if ran and (learned or not judged) else "fail", values,
          "the reward must rise by 0.1 (last 3 vs first 3 steps)" if judged else "too few steps to judge learning")
