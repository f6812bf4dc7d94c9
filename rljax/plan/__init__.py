"""`rljax plan`: will this run fit, and what will it cost, on a TPU slice you have not rented yet?

    rljax plan --config configs/qwen25_05b_gsm8k_grpo.py --config.model.path=scripts/model_configs/qwen2.5-7b \
        --config.mesh.shape='(1,-1,1)' --topology v5p-8 [--config.x=y ...] [--program all] [--json]

Needs only the model's config.json (no weights), compiles the configured run's programs ahead of
time for a deviceless TPU topology (libtpu: `pip install 'rljax[tpu]'`) or for N simulated CPU
devices (`--topology cpu:8`), allocates nothing of the model's size, and prints per chip:
parameters and optimizer state, temporaries, KV cache, peak against the chip's memory, collective
bytes per decode token and per update, compile time, and what to change when it does not fit.
With config.model.lora.rank > 0 it plans the LoRA run: the frozen base (in model.dtype) is reported
apart from the trainable adapters and their optimizer state. docs/plan.md says how each figure is
computed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Sequence

import jax

from rljax import sharding as shd
from rljax.config import resolve_config
from rljax.errors import ConfigError
from rljax.plan import programs as progs, report as rep, timing
from rljax.plan.programs import PROGRAMS, Run, build_run
from rljax.plan.topology import Topology, backends_started, parse_topology
from rljax.trainer.rollouts import split_devices

__all__ = ["main", "make_plan", "parse_topology", "build_run"]

NO_FIT = 3   # exit status when a program does not fit (1 is an error, 2 a usage error)


def make_plan(run: Run, topo: Topology, programs: Sequence[str] = ("sampler", "learner"),
              layers: tuple[int, int] | None = None, dump_dir: str | None = None,
              chip: str | None = None, completion_tokens: float | None = None) -> dict:
  """Compiles `programs` of `run` for `topo` and returns the plan as a JSON-able dict.

  layers: None compiles the model at its depth; (a, b) compiles it at a and b layers and
  extrapolates the compiled figures linearly to the real depth (approximate, docs/plan.md;
  parameters, optimizer state and KV cache stay exact). dump_dir: write each per-chip HLO there.
  chip: estimate the step's time with this chip's rates (timing.KNOWN_CHIPS) instead of the
  topology's own; completion_tokens: the average completion length the estimate assumes (default
  half of sampling.max_new_tokens).
  """
  if topo.hbm_bytes:   # a deviceless chip reports no memory: give the sampler's layout choice its budget
    run = dataclasses.replace(run, decode_budget_bytes=topo.hbm_bytes // 2)
  # The async mode's split: the learner on the first devices' mesh, the generators on their own
  # (rollout.generator_devices / generator_mesh), as the Trainer splits them.
  learner_devices, generator_devices = split_devices(run.config, topo.devices())
  mesh = shd.make_mesh(tuple(run.config.mesh.shape), devices=learner_devices)
  gen_mesh = (shd.make_mesh(tuple(run.config.rollout.generator_mesh), devices=generator_devices,
                            name="config.rollout.generator_mesh") if generator_devices else mesh)
  if generator_devices and "fused" in programs:
    raise ConfigError(f"--program fused with rollout.mode={run.config.rollout.mode!r}: that mode runs the sampler "
                      "and the learner on separate devices; plan --program sampler, learner or all.")
  mesh_shape = dict(mesh.shape)
  meshes = {"learner": mesh, "fused": mesh, "sampler": gen_mesh}
  full = progs.build_inputs(run, mesh)
  gen_full = progs.build_inputs(run, gen_mesh) if generator_devices else full
  inputs = {"learner": full, "fused": full, "sampler": gen_full}
  # The sampler's layout is decided here, at full depth, and imposed on every compile (shallow ones too).
  layout = progs.decode_layout(run, gen_mesh, gen_full)
  run = dataclasses.replace(run, decode_layout=layout)
  if generator_devices:   # the generators hold only the decode copy the learner publishes to them
    inputs["sampler"] = gen_full = progs.with_decode_copy(run, gen_full, gen_mesh, layout)
  if layers is not None:
    a, b = layers
    if not 0 < a < b:
      raise ConfigError(f"--layers={a},{b}: give two depths 0 < a < b (e.g. --layers 1,2).")
    if b >= run.model.num_layers:
      layers = None
  kv = progs.kv_cache_bytes(run.model, layout.mesh(gen_mesh), run.prompts, run.rows, run.prompt_len,
                            run.completion_len)
  reports = []
  for program in programs:
    on, ins = meshes[program], inputs[program]
    if layers is None:
      compiled = progs.compile_program(program, run, on, ins, dump_dir)
    else:
      shallow = [run.with_layers(n) for n in layers]
      points = [progs.compile_program(program, r, on, progs.build_inputs(r, on), dump_dir) for r in shallow]
      compiled = rep.extrapolate(points[0], points[1], run.model.num_layers)
    r = rep.ProgramReport(
        program=program, compiled=compiled,
        # The sampler is given the parameters the state holds: under LoRA the frozen base joined
        # with the adapters (reported apart, as for the learner), otherwise the trained parameters.
        params_bytes=ins.sampler_param_bytes - ins.frozen_bytes if program == "sampler" else ins.param_bytes,
        frozen_params_bytes=ins.frozen_bytes,
        opt_state_bytes=0 if program == "sampler" else ins.opt_bytes,
        ref_params_bytes=0 if program == "sampler" else ins.ref_bytes,
        kv_cache_bytes=0 if program == "learner" else kv,
        expert_params_bytes=ins.expert_sampler_bytes if program == "sampler" else ins.expert_param_bytes,
        expert_opt_state_bytes=0 if program == "sampler" else ins.expert_opt_bytes,
        hbm_bytes=topo.hbm_bytes or compiled.oom_available_bytes, extrapolated_from=layers)
    r.suggestions = rep.suggestions(r, run, topo, dict(on.shape))
    reports.append(r)
  c = run.config
  notes = list(run.notes)
  decode = rep.decode_json(layout, gen_mesh, run, reports, topo)
  if run.lora is not None and run.needs_reference:
    notes.append("LoRA: the KL reference is the frozen base with the adapters off; no second copy of the model "
                 "is kept (reference params 0).")
  if not generator_devices:
    time = step_time(run, topo, mesh_shape, full, layout, kv, reports, chip, completion_tokens)
  else:
    time = split_time(run, topo, dict(gen_mesh.shape), mesh_shape, full, layout, kv, reports, chip,
                      completion_tokens)
    notes.append(f"rollout.mode={run.config.rollout.mode!r}: the sampler is compiled on the generators' mesh "
                 f"{dict(gen_mesh.shape)} ({len(generator_devices)} chips), the learner on {mesh_shape} "
                 f"({len(learner_devices)} chips); a weight publish (every rollout.sync_every updates) gives each "
                 f"generator chip its decode copy, {layout.bytes_per_chip / 2**30:,.2f} GiB.")
  return {
      "topology": {"name": topo.name, "platform": topo.platform, "chips": topo.chips,
                   "description": topo.describe(), "hbm_bytes": topo.hbm_bytes, "mesh": mesh_shape,
                   **({"generator_mesh": dict(gen_mesh.shape)} if generator_devices else {})},
      "model": rep.model_json(run, full.trainable_params),
      "run": {"prompts": run.prompts, "group": run.group, "rows": run.rows,
              "rows_per_chip": progs.rows_per_chip(mesh, run.rows), "prompt_tokens": run.prompt_len,
              "completion_tokens": run.completion_len, "updates": run.updates,
              "micro_batches": c.train.micro_batches, "reference_model": run.needs_reference,
              "reference_copy": run.reference_copy},
      "programs": {r.program: r.to_json() for r in reports},
      "decode": decode,
      "fits": rep.overall_fits(reports),
      "time": time,
      "notes": notes,
  }


def split_time(run: Run, topo: Topology, gen_shape: dict[str, int], learner_shape: dict[str, int], full, layout,
               kv: int, reports: list, chip: str | None, completion_tokens: float | None) -> dict:
  """The roofline estimate of an async step on split meshes: the sampler's phases on the generators'
  chips, the update (and its share of the weight publishes) on the learner's, overlapped (the
  staleness bound lets the generators run a batch ahead), so a step takes the longer of the two;
  tokens/s per chip and MFU over all chips."""
  gen = step_time(run, topo, gen_shape, full, layout, kv, reports, chip, completion_tokens)
  learn = step_time(run, topo, learner_shape, full, layout, kv, reports, chip, completion_tokens)
  chips_gen, chips_learn = math.prod(gen_shape.values()), math.prod(learner_shape.values())
  out = dict(learn)
  for key in ("prefill", "decode_token", "decode_s", "sample_s"):
    out[key] = gen[key]
  out["publish"] = timing.publish(layout.bytes_per_chip, chips_gen, chips_learn, run.config.rollout.sync_every,
                                  learn["rates"]["link"])
  # The learner publishes in its own thread, between updates: its side of a step includes it.
  out["step_s"] = max(gen["sample_s"], learn["update"]["s"] + out["publish"]["s"] / out["publish"]["every"])
  chips = chips_gen + chips_learn
  rescale = learn["step_s"] * chips_learn / (out["step_s"] * chips)   # same tokens and FLOPs, other time x chips
  out["tokens_per_s_per_chip"] = learn["tokens_per_s_per_chip"] * rescale
  out["mfu"] = learn["mfu"] * rescale
  out["split"] = {"generator_chips": chips_gen, "learner_chips": chips_learn, "overlapped": True}
  return out


def step_time(run: Run, topo: Topology, mesh_shape: dict[str, int], full, layout, kv: int,
              reports: list, chip: str | None, completion_tokens: float | None) -> dict:
  """The roofline estimate of one step (rljax/plan/timing.py) from the plan's per-chip figures."""
  from rljax.rollout.slots import decode_slots
  chips = 1
  for n in mesh_shape.values():
    chips *= n
  dtype = run.model.dtype
  if chip:
    rates = timing.spec_rates(chip, dtype)
  elif topo.platform == "cpu":
    rates = timing.host_rates(chips, dtype)
  else:
    rates = timing.spec_rates(topo.generation, dtype)
  completion = run.completion_len / 2 if completion_tokens is None else float(completion_tokens)
  if not 0 < completion <= run.completion_len:
    raise ConfigError(f"--completion-tokens={completion_tokens}: give an average completion length in "
                      f"(0, {run.completion_len}] (sampling.max_new_tokens).")
  by_name = {r.program: r for r in reports}

  def coll(program: str, key: str) -> float:
    r = by_name.get(program) or by_name.get("fused")
    h = (r.compiled.hlo or {}) if r is not None else {}
    return float(sum(h.get(key, {}).values()))

  learner = by_name.get("learner") or by_name.get("fused")
  state = learner.state_bytes if learner is not None else full.param_bytes + full.opt_bytes + full.ref_bytes
  spec = run.spec
  missing = [f"{what} (the {program} was not compiled: --program all)" for what, program in
             (("collectives per decode token", "sampler"), ("collectives per update", "learner"))
             if program not in by_name and "fused" not in by_name]
  out = timing.estimate(
      model=run.model, rates=rates, chips=chips, prompts=run.prompts, group=run.group, prompt_len=run.prompt_len,
      max_new=run.completion_len, completion=completion, decode_rows=decode_slots(spec.sampling, run.rows),
      packed=run.config.train.pack_tokens > 0, shared_prefix=bool(run.config.train.shared_prefix), epochs=spec.epochs,
      extra_forwards=int(run.needs_reference) + int(spec.recompute_old_logprobs),
      sampler_weights_bytes=layout.bytes_per_chip, kv_bytes=kv, state_bytes=state, remat=run.model.remat,
      decode_collective_bytes=coll("sampler", "per_decode_token"),
      update_collective_bytes=coll("learner", "per_update"), updates=run.updates)
  out["left_out"] = missing
  return out


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="rljax plan",
      description="Compile the configured run ahead of time for a TPU topology (or N simulated CPU devices) and "
                  "report per-chip memory, collectives and compile time. Also takes --config FILE and "
                  "--config.FIELD=VALUE overrides, as `rljax train` does.")
  p.add_argument("--topology", required=True,
                 help="v5p-8 (4 chips), v5p-16, v5p-32, v4-8, v5e-8, v6e-8 (Cloud accelerator types), a raw "
                      "topology such as v5p:2x2x2, cpu:N, or gpu:N (this machine's GPUs; with JAX_PLATFORMS=cuda)")
  p.add_argument("--program", default="all", choices=PROGRAMS + ("all",),
                 help="all (default) = sampler and learner, compiled separately; fused = both in one program")
  p.add_argument("--json", action="store_true", help="print the figures as JSON")
  p.add_argument("--hbm-gib", type=float, default=None,
                 help="memory per chip to check against (default: the chip's HBM; cpu:N has none)")
  p.add_argument("--layers", default=None,
                 help="A,B: compile at A and B layers and extrapolate linearly to the model's depth (approximate; "
                      "saves compile time mostly for the sampler, whose decode unrolls the layers)")
  p.add_argument("--chip", default=None, choices=timing.KNOWN_CHIPS,
                 help="estimate the step's time with this chip's spec-sheet rates (default: the topology's chip; "
                      "cpu:N topologies measure this machine)")
  p.add_argument("--completion-tokens", type=float, default=None,
                 help="average completion length the time estimate assumes (default: half sampling.max_new_tokens)")
  p.add_argument("--dump-hlo", metavar="DIR", default=None,
                 help="write each compiled per-chip HLO module to DIR (to read shapes and collectives yourself)")
  return p


def _compile_only() -> None:
  """The plan runs nothing on a device: keep jax on the CPU backend (libtpu is only a compiler here),
  unless the process chose its platforms already."""
  if not backends_started() and not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")


def main(argv: Sequence[str]) -> int:
  """`rljax plan ...`: prints the plan; returns 0 when every program fits (or there is no limit to
  check against), NO_FIT (3) when one does not."""
  _compile_only()
  config, rest = resolve_config(list(argv))
  args = _parser().parse_args(rest)
  topo = parse_topology(args.topology).with_hbm(args.hbm_gib)
  layers = None
  if args.layers:
    try:
      a, b = (int(x) for x in args.layers.split(","))
    except ValueError:
      raise ConfigError(f"--layers={args.layers!r}: expected two depths A,B such as 1,2.") from None
    layers = (a, b)
  programs = ("sampler", "learner") if args.program == "all" else (args.program,)
  plan = make_plan(build_run(config), topo, programs, layers, args.dump_hlo, args.chip, args.completion_tokens)
  if args.json:
    print(json.dumps(plan, indent=2))
  else:
    print(rep.render_text(plan))
  sys.stdout.flush()
  return NO_FIT if plan["fits"] is False else 0
