"""The plan's figures per program and chip, what to change when a program does not fit, and the text
and JSON renderings.

Per program (all figures per chip, bytes):
  params_bytes, opt_state_bytes, ref_params_bytes: exact, from each leaf's shard shape; under LoRA
    params_bytes is the trainable adapters (fp32) and frozen_params_bytes the frozen base (in its
    storage dtype, model.dtype), which is also the KL reference (ref_params_bytes 0);
  expert_params_bytes, expert_opt_state_bytes (mixture of experts): of the above, the routed
    experts' kernels and their optimizer state (most of a MoE model: Qwen3-30B-A3B's are 29B of
    its 30.5B parameters), split like the trainer splits them;
  kv_cache_bytes (sampler, fused): 2 * L * K * Dh * (P * Lp + N * T) * dtype bytes, split like the
    sampler splits the caches (rows over data x fsdp, KV heads over tensor);
  argument / output / alias / temp bytes: the compiler's memory analysis of the per-chip program;
  sum_bytes = argument + output - alias + temp (every buffer live at once: an upper bound);
  peak_bytes: the TPU compiler's live-range peak (memory_analysis().peak_memory_in_bytes), the
    compiler's "needs" figure when it refused the program, or sum_bytes on CPU;
  fits: peak <= the chip's HBM;
  collectives: bytes by kind per decode token (one iteration of the decode loop) and per
    optimizer update, from the per-chip HLO (rljax/plan/hlo.py).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rljax.models import families
from rljax.plan.programs import Compiled, Run, rows_per_chip
from rljax.plan.topology import GIB, Topology, next_larger

MIB = 2**20
# Above this many bytes all-gathered per decode token per chip, the plan warns and suggests a mesh.
DECODE_GATHER_WARN_BYTES = MIB


def fmt_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  if abs(n) >= GIB:
    return f"{n / GIB:.2f} GiB"
  if abs(n) >= MIB:
    return f"{n / MIB:.1f} MiB"
  if abs(n) >= 1024:
    return f"{n / 1024:.1f} KiB"
  return f"{int(n)} B"


def extrapolate(a: Compiled, b: Compiled, layers: int) -> Compiled:
  """Compiled figures of a `layers`-deep model, linear in depth through two shallower compiles.

  Argument, output, alias and temporary bytes, the compiler's "needs" figure and the collective
  bytes all grow by a fixed amount per layer (stacked per-layer weights, saved activations, one
  all-gather per weight per layer); the slope is (b - a) / (b.layers - a.layers). The largest
  tensors are those of the deeper compile. Compile time is the sum of both (what was spent).
  """
  span = b.layers - a.layers
  at = lambda x, y: None if x is None or y is None else int(round(x + (y - x) * (layers - a.layers) / span))
  out = Compiled(a.program, layers, a.compile_s + b.compile_s,
                 argument_bytes=at(a.argument_bytes, b.argument_bytes), output_bytes=at(a.output_bytes, b.output_bytes),
                 alias_bytes=at(a.alias_bytes, b.alias_bytes), temp_bytes=at(a.temp_bytes, b.temp_bytes),
                 compiler_peak_bytes=at(a.compiler_peak_bytes, b.compiler_peak_bytes),
                 oom_available_bytes=a.oom_available_bytes or b.oom_available_bytes, error=b.error or a.error)
  if a.oom_needs_bytes is not None or b.oom_needs_bytes is not None:
    out.oom_needs_bytes = at(a.peak_bytes, b.peak_bytes)
  if a.hlo and b.hlo:
    h = dict(b.hlo)
    for key in ("per_decode_token", "outside_decode", "per_update"):
      kinds = set(a.hlo[key]) | set(b.hlo[key])
      h[key] = {k: max(0, at(a.hlo[key].get(k, 0), b.hlo[key].get(k, 0))) for k in sorted(kinds)}
    out.hlo = h
  return out


@dataclasses.dataclass
class ProgramReport:
  """One program's per-chip figures (see the module docstring)."""
  program: str
  compiled: Compiled
  params_bytes: int
  opt_state_bytes: int
  ref_params_bytes: int
  kv_cache_bytes: int
  hbm_bytes: int | None
  frozen_params_bytes: int = 0
  expert_params_bytes: int = 0       # of params_bytes (+ frozen), the routed experts' kernels (MoE)
  expert_opt_state_bytes: int = 0    # of opt_state_bytes, those kernels' optimizer state
  extrapolated_from: tuple[int, int] | None = None
  suggestions: list[str] = dataclasses.field(default_factory=list)

  @property
  def peak_bytes(self) -> int | None:
    return self.compiled.peak_bytes

  @property
  def state_bytes(self) -> int:
    """What the program holds of the train state: parameters (trainable and frozen), optimizer state
    and reference copy (the sampler: the parameters it is given)."""
    return self.params_bytes + self.frozen_params_bytes + self.opt_state_bytes + self.ref_params_bytes

  @property
  def fits(self) -> bool | None:
    if self.compiled.oom_needs_bytes is not None or (self.compiled.error and self.peak_bytes is None):
      return False
    if self.hbm_bytes is None or self.peak_bytes is None:
      return None
    return self.peak_bytes <= self.hbm_bytes

  def to_json(self) -> dict:
    c = self.compiled
    h = c.hlo or {}
    out = {
        "program": self.program,
        "fits": self.fits,
        "peak_bytes": self.peak_bytes,
        "hbm_bytes": self.hbm_bytes,
        "params_bytes": self.params_bytes,
        "frozen_params_bytes": self.frozen_params_bytes,
        "state_bytes": self.state_bytes,
        "opt_state_bytes": self.opt_state_bytes,
        "ref_params_bytes": self.ref_params_bytes,
        "expert_params_bytes": self.expert_params_bytes,
        "expert_opt_state_bytes": self.expert_opt_state_bytes,
        "kv_cache_bytes": self.kv_cache_bytes,
        "argument_bytes": c.argument_bytes,
        "output_bytes": c.output_bytes,
        "alias_bytes": c.alias_bytes,
        "temp_bytes": c.temp_bytes,
        "sum_bytes": c.sum_bytes,
        "peak_source": c.peak_source,
        "compiler_refused": c.oom_needs_bytes is not None,
        "compile_s": round(c.compile_s, 2),
        "layers_compiled": list(self.extrapolated_from) if self.extrapolated_from else c.layers,
        "extrapolated": self.extrapolated_from is not None,
        "error": c.error,
        "suggestions": self.suggestions,
    }
    if h:
      out["collectives"] = {
          "per_decode_token_bytes": sum(h["per_decode_token"].values()) if self.program != "learner" else None,
          "per_update_bytes": sum(h["per_update"].values()) if self.program != "sampler" else None,
          "outside_decode_bytes": sum(h["outside_decode"].values()),
          "per_decode_token_by_kind": h["per_decode_token"],
          "per_update_by_kind": h["per_update"],
          "decode_loops": h["decode_loops"],
      }
      out["largest_tensors"] = h["largest_tensors"]
    return out


def suggestions(rep: ProgramReport, run: Run, topo: Topology, mesh_shape: dict[str, int]) -> list[str]:
  """What to change when a program does not fit, most effective first."""
  if rep.fits is not False:
    return []
  out = []
  cfg, mc = run.config, run.model
  hbm = rep.hbm_bytes or rep.compiled.oom_available_bytes
  state = rep.state_bytes
  data, fsdp, tensor = mesh_shape["data"], mesh_shape["fsdp"], mesh_shape["tensor"]
  chips = data * fsdp * tensor
  if fsdp * tensor == 1 and chips > 1:
    out.append(f"shard the parameters and optimizer state: --config.mesh.shape='(1, -1, 1)' (now {state / GIB:.1f} "
               f"GiB per chip, replicated over data={data}; fsdp={chips} divides it by {chips}).")
  bigger = next_larger(topo)
  if hbm and state > 0.6 * hbm:
    out.append(f"parameters + optimizer state alone take {fmt_bytes(state)} of {fmt_bytes(hbm)} per chip: "
               f"use a larger slice{f' (--topology {bigger})' if bigger else ''} so fsdp splits them further.")
  if rep.program in ("learner", "fused"):
    if not mc.remat:
      out.append("--config.model.remat=True: keep one layer's activations in the backward pass, not all "
                 f"{mc.num_layers} layers'.")
    t = cfg.train
    more = t.micro_batches * 2
    if t.prompts_per_step % (t.mini_batches * more) == 0:
      out.append(f"--config.train.micro_batches={more}: each micro-batch's activations are half as large "
                 "(same update).")
    attention = getattr(mc, "attention", None)
    if attention is not None and attention not in ("chunked", "splash"):
      out.append("--config.model.attention='chunked' (or 'splash' on TPU): no [T, T] score matrix per head.")
  if rep.program in ("sampler", "fused") and hbm and rep.kv_cache_bytes > 0.25 * hbm:
    k = mc.num_kv_heads
    out.append(f"the KV cache takes {fmt_bytes(rep.kv_cache_bytes)} per chip: fewer rows per step "
               f"(train.prompts_per_step x sampling.num_samples = {run.rows}), or split the KV heads "
               f"({k}) over a tensor axis (mesh.shape=(1, fsdp, t) with t dividing {k}).")
  if bigger and not any("larger slice" in s for s in out):
    out.append(f"a larger slice: --topology {bigger} (activations and state split over more chips).")
  out.append(f"shorter sequences: data.max_prompt_tokens={run.prompt_len} + sampling.max_new_tokens="
             f"{run.completion_len} tokens per row.")
  return out


# ---- rendering --------------------------------------------------------------------------------


def render_text(plan: dict) -> str:
  """The human-readable plan: one column per program."""
  t, m, r = plan["topology"], plan["model"], plan["run"]
  progs = plan["programs"]
  lines = [
      f"rljax plan: {m['name']} ({m['params'] / 1e9:.2f}B parameters, {m['layers']} layers) on "
      + (t["description"] if t["description"].startswith(t["name"] + ",") else f"{t['name']} ({t['description']})"),
      f"mesh (data, fsdp, tensor) = ({t['mesh']['data']}, {t['mesh']['fsdp']}, {t['mesh']['tensor']}); "
      f"{r['prompts']} prompt{'s' * (r['prompts'] != 1)} x {r['group']} samples = {r['rows']} rows "
      f"({r['rows_per_chip']} per chip); "
      f"{r['prompt_tokens']} prompt + {r['completion_tokens']} completion tokens per row",
      f"compute {m['dtype']}, parameters {m['param_dtype']}"
      + (f" (frozen base) + float32 LoRA adapters, rank {m['lora']['rank']} on {','.join(m['lora']['targets'])}: "
         f"{m['trainable_params'] / 1e6:.2f}M trainable" if m.get("lora") else "")
      + (f", mixture of experts: {m['moe']['experts_per_token']} of {m['moe']['num_experts']} experts per token, "
         f"{m['moe']['active_params'] / 1e9:.2f}B active parameters, routing replay "
         f"{'on' if m['moe']['routing_replay'] else 'off'}" if m.get("moe") else "")
      + f", remat {'on' if m['remat'] else 'off'}"
      + (f", attention {m['attention']}" if m.get("attention") else "")
      + f", {r['updates']} optimizer update(s) per step, {r['micro_batches']} micro-batch(es) each",
  ]
  for note in plan.get("notes", []):
    lines.append(f"note: {note}")
  dec = plan.get("decode")
  if dec:
    budget = fmt_bytes(dec["budget_bytes"]) if dec["budget_bytes"] else "none"
    lines.append(f"sampler decode layout: {dec['description']}, {dec['rows_per_chip']} rows per chip; weights "
                 f"{fmt_bytes(dec['weights_bytes_per_chip'])} per chip (budget {budget}), decided "
                 f"at {dec['decided_at']}; all-gathered per decode token per chip: "
                 f"{fmt_bytes(dec['all_gather_bytes_per_token'])}")
    if dec["warning"]:
      lines.append(f"WARNING: {dec['warning']}")
  names = list(progs)
  lora = bool(m.get("lora"))
  rows = [
      ("trainable params (adapters)" if lora else "parameters", lambda p: fmt_bytes(p["params_bytes"])),
  ]
  if lora:
    rows.append(("frozen base params", lambda p: fmt_bytes(p["frozen_params_bytes"])))
  if m.get("moe"):
    rows.append(("  of which experts", lambda p: fmt_bytes(p["expert_params_bytes"])))
  rows += [
      ("optimizer state", lambda p: fmt_bytes(p["opt_state_bytes"]) if p["program"] != "sampler" else "-"),
      *([("  of which experts", lambda p: fmt_bytes(p["expert_opt_state_bytes"]) if p["program"] != "sampler"
          else "-")] if m.get("moe") else []),
      ("reference params", lambda p: fmt_bytes(p["ref_params_bytes"]) if p["ref_params_bytes"] else
       ("- (the base)" if lora and r["reference_model"] and p["program"] != "sampler" else "-")),
      ("state (sum of the above)", lambda p: fmt_bytes(p["state_bytes"])),
      ("KV cache", lambda p: fmt_bytes(p["kv_cache_bytes"]) if p["program"] != "learner" else "-"),
      ("temporaries", lambda p: fmt_bytes(p["temp_bytes"])),
      ("arguments + outputs - aliased", lambda p: fmt_bytes(None if p["argument_bytes"] is None else
                                                             p["argument_bytes"] + p["output_bytes"]
                                                             - p["alias_bytes"])),
      ("sum (all live at once)", lambda p: fmt_bytes(p.get("sum_bytes"))),
      ("peak", lambda p: fmt_bytes(p["peak_bytes"]) + {"refused": " (needs)", "compiler": " (compiler)"}.get(
          p.get("peak_source"), "")),
      ("HBM per chip", lambda p: fmt_bytes(p["hbm_bytes"])),
      ("fits", lambda p: {True: "yes", False: "NO", None: "?"}[p["fits"]]),
      ("collectives / decode token", lambda p: fmt_bytes(p["collectives"]["per_decode_token_bytes"])
       if "collectives" in p and p["collectives"]["per_decode_token_bytes"] is not None else "-"),
      ("collectives / update", lambda p: fmt_bytes(p["collectives"]["per_update_bytes"])
       if "collectives" in p and p["collectives"]["per_update_bytes"] is not None else "-"),
      ("compile time", lambda p: f"{p['compile_s']:.1f} s"),
  ]
  width = max(len(label) for label, _ in rows) + 2
  col = 22
  lines.append("")
  lines.append("per chip".ljust(width) + "".join(n.rjust(col) for n in names))
  for label, get in rows:
    lines.append(label.ljust(width) + "".join(get(progs[n]).rjust(col) for n in names))
  for n in names:
    p = progs[n]
    if p["extrapolated"]:
      a, b = p["layers_compiled"]
      lines.append(f"{n}: compiled at {a} and {b} layers, figures extrapolated linearly to {m['layers']} layers.")
    if p.get("largest_tensors"):
      big = ", ".join(f"{x['shape']} ({fmt_bytes(x['bytes'])})" for x in p["largest_tensors"][:3])
      lines.append(f"{n}: largest tensors per chip: {big}")
    if p["error"]:
      lines.append(f"{n}: the compiler refused: {p['error']}")
  for n in names:
    if progs[n]["suggestions"]:
      lines.append("")
      lines.append(f"{n} does not fit; what to change:")
      lines.extend(f"  - {s}" for s in progs[n]["suggestions"])
  if plan.get("time"):
    from rljax.plan.timing import render as render_time
    lines.append("")
    lines.extend(render_time(plan["time"]))
  lines.append("")
  verdict = plan["fits"]
  lines.append({True: "verdict: fits", False: "verdict: does NOT fit",
                None: "verdict: no memory limit to check against (give --hbm-gib)"}[verdict])
  return "\n".join(lines)


def decode_json(layout, mesh, run: Run, reports: list[ProgramReport], topo: Topology) -> dict | None:
  """The sampler's decode layout (`rljax.sharding.DecodeLayout`), decided at the model's full depth
  from the bytes of its compute-dtype weights against the budget (half a chip's memory), the bytes
  all-gathered per decode token per chip in the compiled decode loop, and, above
  DECODE_GATHER_WARN_BYTES, a warning with a mesh to use. None when no program decodes."""
  decoding = [r for r in reports if r.program in ("sampler", "fused")]
  if not decoding:
    return None
  out = layout.to_json(mesh)
  out["rows_per_chip"] = rows_per_chip(layout.mesh(mesh), run.rows)
  experts = _expert_split(run, layout.mesh(mesh))
  if experts > 1:   # DECODE_RULES keep the routed experts split over fsdp (expert parallelism)
    out["description"] = out["description"].replace(
        "every chip holds the whole model", "every chip holds the whole model except the routed experts")
    out["description"] += (f"; routed experts split over {experts} chips (expert parallel: tokens move to "
                           "the experts, not weights to the tokens)")
  out["decided_at"] = (f"full depth ({run.model.num_layers} layers), from the weights' bytes in "
                       f"{jnp.dtype(run.model.compute_dtype).name} against the budget (not from a compile)")
  h = decoding[0].compiled.hlo or {}
  gathered = h["per_decode_token"].get("all-gather", 0) if h else None
  out["all_gather_bytes_per_token"] = gathered
  out["from_program"] = decoding[0].program
  out["warning"] = None
  if gathered is not None and gathered > DECODE_GATHER_WARN_BYTES:
    d, f, t = (mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    chips = d * f * t
    dispatch = (" (with experts split over chips this includes moving tokens to their experts: "
                "docs/models.md#expert-parallelism)" if experts > 1 else "")
    if layout.fallback:
      bigger = next_larger(topo)
      larger = f" (--topology {bigger})" if bigger else ""
      out["warning"] = (f"decoding all-gathers {fmt_bytes(gathered)} of weights per token per chip: the weights do "
                        f"not fit the budget ({fmt_bytes(layout.budget)}, half a chip) even tensor-parallel over all "
                        f"{chips} chips, so they are split over fsdp too. Use a larger slice{larger}, where a "
                        "tensor axis over more chips holds them.")
    else:
      k = 2 if f % 2 == 0 else f
      out["warning"] = (f"decoding all-gathers {fmt_bytes(gathered)} per token per chip in this layout{dispatch}: give "
                        f"decoding a tensor axis, e.g. --config.mesh.shape='({d}, {f // k}, {t * k})' ({chips} chips).")
  return out


def _expert_split(run: Run, decode_mesh) -> int:
  """Over how many chips the sampler splits a mixture of experts' routed experts (1: dense, or
  experts not split): the fsdp axis of the decode mesh, where it divides the expert count."""
  moe = getattr(run.model, "moe", None)
  f = decode_mesh.shape["fsdp"]
  return f if moe is not None and f > 1 and moe.num_experts % f == 0 else 1


def overall_fits(reports: list[ProgramReport]) -> bool | None:
  verdicts = [r.fits for r in reports]
  if any(v is False for v in verdicts):
    return False
  if any(v is None for v in verdicts):
    return None
  return True


def model_json(run: Run, trainable_params: int | None = None) -> dict:
  """The model's shape and dtypes. params: the base model's parameter count; trainable_params: what the
  optimizer updates (the adapters under LoRA); lora: rank, alpha, dropout, targets, or None."""
  mc = run.model
  lc = mc.lora
  out = {"name": run.model_source, "params": mc.num_params, "layers": mc.num_layers, "hidden": mc.hidden_size,
         "heads": mc.num_heads, "kv_heads": mc.num_kv_heads, "vocab": mc.vocab_size, "dtype": mc.dtype,
         "param_dtype": mc.param_dtype, "remat": mc.remat,
         "trainable_params": mc.num_params if trainable_params is None else trainable_params,
         "lora": None if lc is None else {"rank": lc.rank, "alpha": lc.alpha, "dropout": lc.dropout,
                                          "targets": list(lc.targets)}}
  if getattr(mc, "attention", None) is not None:
    out["attention"] = mc.attention
  if getattr(mc, "moe", None) is not None:
    m = mc.moe
    out["moe"] = {"num_experts": m.num_experts, "experts_per_token": m.experts_per_token,
                  "expert_intermediate_size": m.intermediate_size, "moe_layers": sum(mc.moe_layers),
                  "active_params": families.get(mc.architecture).active_params(mc),
                  "routing_replay": m.routing_replay, "kernel": m.kernel, "dispatch": m.dispatch}
  return out
