"""Device check parts: sampler tokens/s and learner MFU in bf16 at Qwen2.5 shapes with random weights,
and the peak device memory next to `rljax plan`'s figures for the same run.

Options (gpu_check.py --option KEY=JSON): speed_rows_0.5b / speed_rows_1.5b: sampler batch sizes in
rows (default [16, 64, 256] on the GPU); learner_rows_0.5b / learner_rows_1.5b: the rows at which the
update is timed too (default [64, 256]); speed_group (8), speed_prompt_len (128), speed_new_tokens (256),
speed_repeats (2); plan_rows (64, the first configuration of speed_0.5b, whose peak memory the plan
part compares with); plan_measured_gib (that peak from an earlier run, when speed_0.5b is not in this one).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from checklib import (
  GIB,
  RECIPE,
  ROOT,
  Context,
  Recorder,
  build_workload,
  finite,
  load_run_config,
  median,
  memory_stats,
  override_args,
  random_prompts,
  replicated_key,
  run_overrides,
  step_flops,
  timed,
)


def _settings(ctx: Context, model: str) -> dict:
  o = ctx.options
  if ctx.cpu:
    d = dict(rows=[8], learner=[8], group=4, prompt_len=8, new_tokens=8, repeats=1, plan_rows=8)
  else:
    d = dict(rows=[16, 64, 256], learner=[64, 256], group=8, prompt_len=128, new_tokens=256, repeats=2, plan_rows=64)
  d["rows"] = list(o.get(f"speed_rows_{model}", d["rows"]))
  d["learner"] = list(o.get(f"learner_rows_{model}", d["learner"]))
  for key in ("group", "prompt_len", "new_tokens", "repeats", "plan_rows"):
    d[key] = int(o.get(f"speed_{key}" if key != "plan_rows" else key, d[key]))
  # Largest first, so a run short of time loses the least telling size; for 0.5b the plan's
  # configuration before all (the process's peak memory after it is then its own).
  d["rows"] = sorted(d["rows"], key=lambda r: (not (model == "0.5b" and r == d["plan_rows"]), -r))
  return d


def _speed(rec: Recorder, ctx: Context, model: str) -> None:
  """Per batch size: sampler tokens/s and MFU (prefill + decode FLOPs over the time of one `generate`
  call), then, at the learner's batch sizes, the update's seconds and MFU (forward + backward + the
  lp_old recompute of a bf16 run, rljax/flops.py), against the device's bf16 peak."""
  import jax

  from rljax import flops
  from rljax.trainer.setup import stand_in_reward_fn
  s = _settings(ctx, model)
  rec.guarded(f"Qwen2.5-{model.upper()} shape", lambda: _shape_row(rec, model))
  if ctx.cpu and model != "0.5b":
    rec.row("timed runs", "skipped", note="--cpu times the tiny stand-in once, in speed_0.5b")
    return
  peak, source = flops.device_peak_flops("bfloat16")
  shape = "tiny stand-in (--cpu)" if ctx.cpu else f"Qwen2.5-{model.upper()} shapes"
  for rows in s["rows"]:
    label = f"{rows} rows x {s['prompt_len']}+{s['new_tokens']} tokens"

    def check(rows=rows, label=label):
      group = s["group"]
      if rows % group:
        raise ValueError(f"speed rows {rows} are not a multiple of the group size {group}")
      cfg = load_run_config(run_overrides(model, rows // group, group, s["prompt_len"], s["new_tokens"], ctx.cpu))
      w = build_workload(cfg)
      ids, mask = random_prompts(w)
      params, key = w.state.model_params(), replicated_key(w, 0)
      first, times, rollout = timed(lambda: jax.block_until_ready(w.generate(params, key, ids, mask)), s["repeats"])
      tokens = int(jax.device_get(rollout.lengths).sum())
      work = step_flops(w)
      t = median(times)
      values = {"tokens_per_s": tokens / t, "sample_mfu": work["sample"] / t / peak, "sample_s": t,
                "sample_compile_s": first - t}
      if rows in s["learner"]:
        scored = rollout.with_rewards(*stand_in_reward_fn(w.run.components)(rollout.tokens, rollout.lengths))
        holder = {"state": w.state}

        def update():
          holder["state"], metrics = w.update(holder["state"], scored)
          return jax.block_until_ready(metrics)

        first_u, times_u, metrics = timed(update, s["repeats"])
        tu = median(times_u)
        values.update(update_s=tu, update_mfu=work["update"] / tu / peak,
                      update_tokens_per_s=rows * (s["prompt_len"] + s["new_tokens"]) / tu,
                      update_compile_s=first_u - tu, loss=float(metrics["loss"]) if "loss" in metrics else None)
      stats = memory_stats(jax.devices()[0])
      if "peak_bytes_in_use" in stats:
        values["peak_gib_so_far"] = stats["peak_bytes_in_use"] / GIB
      if model == "0.5b" and rows == s["plan_rows"]:
        values["plan_config"] = True
      ok = tokens == rows * s["new_tokens"] and all(finite(v) for k, v in values.items()
                                                   if isinstance(v, float) and k != "loss")
      rec.row(label, "ok" if ok else "fail", values,
              f"{shape}, bf16 compute, fp32 params + AdamW, remat, attention auto, 1 device; median of "
              f"{s['repeats']} after a compile run; MFU: rljax.flops counts over the env part's peak "
              f"({peak:.3g} FLOP/s)")
    rec.guarded(label, check)
    gc.collect()   # this configuration's arrays go before the next one's (check's locals are gone)


def _shape_row(rec: Recorder, model: str) -> None:
  """The model's shape from its config.json (scripts/model_configs), as rljax reads it."""
  from rljax import flops
  from rljax.trainer.setup import read_model_config
  mc, source, _ = read_model_config(load_run_config(run_overrides(model, 1, 8, 128, 256, cpu=False)))
  rec.row(f"Qwen2.5-{model.upper()} shape", "ok",
          {"params_b": mc.num_params / 1e9, "layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads,
           "kv_heads": mc.num_kv_heads, "vocab": mc.vocab_size,
           "gflops_per_token_fwd_at_384": flops.forward_flops(mc, 1, 192) / 1e9},
          os.path.relpath(source, ROOT))


def speed_05b(rec: Recorder, ctx: Context) -> None:
  _speed(rec, ctx, "0.5b")


def speed_15b(rec: Recorder, ctx: Context) -> None:
  _speed(rec, ctx, "1.5b")


def _measured_peak(results_path: str) -> float | None:
  """speed_0.5b's process peak after its first configuration (the plan's), from the results so far."""
  try:
    with open(results_path, encoding="utf-8") as f:
      results = json.load(f)
  except (OSError, ValueError):
    return None
  for part in results.get("parts", []):
    for row in part["rows"] if part["name"] == "speed_0.5b" else ():
      if row["values"].get("plan_config") and "peak_gib_so_far" in row["values"]:
        return float(row["values"]["peak_gib_so_far"])
  return None


def plan_memory(rec: Recorder, ctx: Context) -> None:
  """`rljax plan --topology gpu:1` (cpu:1 with --cpu) for speed_0.5b's first configuration, next to
  the peak device memory that configuration's sampler + update took (peak_bytes_in_use of XLA's
  allocator, read by speed_0.5b). The plan's figure per program is the compiler's memory analysis
  summed as if every buffer were live at once (an upper bound); the measured run holds the optimizer
  state while sampling and the rollout while updating, and its peak includes compile-time
  autotuning scratch. The plan's compile_s comes from the run's compilation cache when speed_0.5b
  compiled the same programs (gpu_check.py shares one cache between the parts)."""
  s = _settings(ctx, "0.5b")
  rows, group = s["plan_rows"], s["group"]
  overrides = run_overrides("0.5b", rows // group, group, s["prompt_len"], s["new_tokens"], ctx.cpu)
  topology = "cpu:1" if ctx.cpu else "gpu:1"
  cmd = [sys.executable, "-m", "rljax.cli", "plan", "--config", RECIPE,
         *[f"--config.{a}" for a in override_args(overrides)], "--topology", topology, "--json"]
  env = dict(os.environ, JAX_PLATFORMS="cpu" if ctx.cpu else "cuda")
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=max(ctx.seconds_left() - 5, 1))
  if out.returncode not in (0, 3):
    sys.stdout.write(out.stdout[-4000:] + out.stderr[-4000:])
    raise RuntimeError(f"rljax plan exited {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}")
  plan = json.loads(out.stdout[out.stdout.index("{"):])
  progs = plan["programs"]
  values = {f"plan_{name}_gib": (p["peak_bytes"] or 0) / GIB for name, p in progs.items()}
  values.update({f"plan_{name}_compile_s": p["compile_s"] for name, p in progs.items()})
  values["plan_opt_state_gib"] = progs["learner"]["opt_state_bytes"] / GIB
  if plan["topology"].get("hbm_bytes"):
    values["device_limit_gib"] = plan["topology"]["hbm_bytes"] / GIB
  label = f"rljax plan --topology {topology}, {'tiny stand-in' if ctx.cpu else 'Qwen2.5-0.5B shapes'}, {rows} rows"
  measured = None if ctx.cpu else _measured_peak(ctx.results_path)
  given = ctx.options.get("plan_measured_gib")
  if ctx.cpu:
    rec.row(label, "ok", values, "the plan's sums (CPU compiler); the measured peak " + "needs a CUDA GPU")
    return
  if measured is None and given is None:
    rec.row(label, "fail", values, "no measured peak: speed_0.5b did not record its first configuration in this "
            "run (name it in the same run, or pass an earlier run's peak_gib_so_far as --option plan_measured_gib=G)")
    return
  bound = max(values["plan_learner_gib"], values["plan_sampler_gib"] + values["plan_opt_state_gib"])
  from_option = measured is None
  measured = float(given) if from_option else measured
  values.update(measured_peak_gib=measured, measured_over_plan=measured / bound)
  rec.row(label, "ok", values, "plan: max(learner, sampler + optimizer state), every buffer live at once; "
          "measured: XLA allocator peak (includes autotuning scratch)"
          + ("; the peak from --option plan_measured_gib (an earlier run's speed_0.5b)" if from_option else ""))
