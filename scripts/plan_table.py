"""Regenerates the README's "what fits" table with `rljax plan`.

    JAX_PLATFORMS=cpu python scripts/plan_table.py [--models 1.5b,7b,14b,32b] [--tokens 4096,16384,32768]
        [--topologies v5p-8,v5p-32] [--programs learner[,sampler]] [--layers 0|A,B] [--out runs/plan_table.jsonl]
        [--render-only]

Every cell is the plan of one run (the Qwen2.5 GSM8K recipe with the model swapped for a
`scripts/model_configs/` shape), exactly what this command prints as JSON:

    rljax plan --config rljax/configs/qwen25_05b_gsm8k_grpo.py --config.model.path=scripts/model_configs/qwen2.5-7b \
        --config.model.dtype=bfloat16 --config.model.remat=True --config.model.attention=chunked \
        --config.rl.kl_coef=0.0 --config.train.prompts_per_step=1 --config.sampling.num_samples=8 \
        --config.train.mini_batches=1 --config.data.max_prompt_tokens=1024 --config.sampling.max_new_tokens=3072 \
        --config.mesh.shape='(1,4,1)' --topology v5p-8 --program learner --json

8 rows (1 prompt x 8 samples) of `tokens` tokens each (1024 prompt + the rest completion), bf16
compute, fp32 parameters and AdamW, no reference model, remat on, chunked attention. The mesh puts
the 8 rows on an fsdp axis of min(chips, 8) chips and the rest of the chips on a tensor axis
(v5p-32: (1, 8, 2)). Each cell compiles the model at full depth (1-5 minutes of CPU per program
on a 2-core machine); with `--layers A,B` it compiles at A and B layers and extrapolates the
compiled figures linearly to the model's depth (docs/plan.md; cells marked (x)), which saves
little for the learner, whose layers are one scanned body. Cells already in `--out` are not
compiled again; `--render-only` prints the table of what is there (n/c: not compiled).

`--lora-rank R` builds the LoRA vs full fine-tuning comparison instead: every cell is compiled twice,
with `--config.model.lora.rank=R` (adapters on all 7 projections, the base frozen in bf16, fp32
adapters and AdamW moments; docs/plan.md) and with rank 0 (full fine-tuning), and the table has one
row per (model, tokens, topology) with both runs' per-chip state (parameters + optimizer state)
and peak side by side, e.g.

    JAX_PLATFORMS=cpu python scripts/plan_table.py --lora-rank 16 --models 7b,14b,32b --tokens 4096 \
        --topologies v5e-8,v5p-8 --programs learner --out runs/plan_table_lora.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join("rljax", "configs", "qwen25_05b_gsm8k_grpo.py")
ROWS = 8
PROMPT_TOKENS = 1024


def cell_argv(model: str, tokens: int, topology: str, chips: int, program: str, layers: str,
              lora_rank: int = 0) -> list[str]:
  """The `rljax plan` arguments of one cell (lora_rank > 0: a LoRA run of that rank, all 7 projections)."""
  fsdp = min(chips, ROWS)
  argv = ["--config", RECIPE, f"--config.model.path=scripts/model_configs/qwen2.5-{model}",
          "--config.model.dtype=bfloat16", "--config.model.remat=True", "--config.model.attention=chunked",
          "--config.rl.kl_coef=0.0", "--config.train.prompts_per_step=1", f"--config.sampling.num_samples={ROWS}",
          "--config.train.mini_batches=1", f"--config.data.max_prompt_tokens={PROMPT_TOKENS}",
          f"--config.sampling.max_new_tokens={tokens - PROMPT_TOKENS}",
          f"--config.mesh.shape=(1,{fsdp},{chips // fsdp})", "--topology", topology, "--program", program, "--json"]
  if lora_rank:
    argv.insert(4, f"--config.model.lora.rank={lora_rank}")
  if layers != "0":
    argv += ["--layers", layers]
  return argv


def run_cell(argv: list[str]) -> dict:
  """The plan of one cell, in this process (libtpu and jax start once for the whole table)."""
  import contextlib
  import io

  import jax

  from rljax.plan import main
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    main(argv)
  jax.clear_caches()
  return json.loads(out.getvalue())


def gib(n) -> str:
  return "-" if n is None else f"{n / 2**30:.1f}"


def render(rows: list[dict], models, tokens, topologies, programs) -> str:
  """Markdown: one row per (model, tokens), one column per (topology, program): GiB per chip and the
  verdict (`cell`); for a cell not compiled, "fits (Nk fits)" when a longer row fits, else `n/c`."""
  by = {key(r)[:4]: r for r in rows}
  cols = [(t, prog) for t in topologies for prog in programs]
  head = "| model | tokens / row |" + "".join(f" {t} ({parse_chips(t)} chips) {prog} |" for t, prog in cols)
  lines = [head, "|---|---|" + "---|" * len(cols)]
  for m in models:
    for tok in tokens:
      cells = []
      for t, prog in cols:
        r = by.get((m, tok, t, prog))
        if r is None:
          # Memory grows with the tokens per row: a cell fits when a longer one fits.
          longer = [k for k in tokens if k > tok and (m, k, t, prog) in by
                    and cell(by[(m, k, t, prog)]["plan"], prog).endswith(", fits")]
          cells.append(f"fits ({longer[0] // 1024}k fits)" if longer else "n/c")
          continue
        cells.append(cell(r["plan"], prog) + ("" if r["layers"] == "0" else " (x)"))
      lines.append(f"| Qwen2.5-{m.upper()} | {tok // 1024}k | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def cell(plan: dict, program: str) -> str:
  """One cell: the sum of the memory analysis (every buffer live at once, an upper bound), the TPU
  compiler's peak where the plan has it, and the verdict. On a TPU topology the verdict is the
  compiler's: it compiled the program within the chip's HBM, or refused it and said what it needs."""
  p = plan["programs"][program]
  if p["compiler_refused"]:
    return f"needs {gib(p['peak_bytes'])} GiB, **does not fit**"
  total = p.get("sum_bytes")
  if total is None:
    total = p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]
  peak = f" (peak {gib(p['peak_bytes'])} GiB)" if p.get("peak_source") == "compiler" else ""
  if plan["topology"]["platform"] == "tpu":
    verdict = "fits"
  else:
    verdict = {True: "fits", False: "**does not fit**", None: "?"}[p["fits"]]
  return f"{gib(total)} GiB{peak}, {verdict}"


def key(r: dict) -> tuple:
  """A row's cell: (model, tokens, topology, program, LoRA rank); rows from before LoRA are rank 0."""
  return r["model"], r["tokens"], r["topology"], r["program"], r.get("lora_rank", 0)


def state_bytes(p: dict) -> int:
  """Per-chip train state of a program: parameters (trainable and frozen) + optimizer state + reference."""
  if "state_bytes" in p:
    return p["state_bytes"]
  return p["params_bytes"] + p.get("frozen_params_bytes", 0) + p["opt_state_bytes"] + p["ref_params_bytes"]


def peak_cell(plan: dict, program: str) -> str:
  """The peak per chip and the verdict: the TPU compiler's peak of a program it compiled (it fits),
  or its "needs" figure when it refused the program."""
  p = plan["programs"][program]
  if p["compiler_refused"]:
    return f"needs {gib(p['peak_bytes'])} GiB, **does not fit**"
  if plan["topology"]["platform"] == "tpu":
    return f"{gib(p['peak_bytes'])} GiB, fits"
  return f"{gib(p['peak_bytes'])} GiB, " + {True: "fits", False: "**does not fit**", None: "?"}[p["fits"]]


def render_lora(rows: list[dict], models, tokens, topologies, programs, rank: int) -> str:
  """Markdown: one row per (model, tokens, topology); per program, LoRA rank `rank` and full
  fine-tuning side by side: the per-chip train state and the peak with the verdict."""
  by = {key(r): r for r in rows}
  head = "| model | tokens / row | topology |"
  for prog in programs:
    head += (f" LoRA r{rank} {prog}: state | LoRA r{rank} {prog}: peak |"
             f" full FT {prog}: state | full FT {prog}: peak |")
  lines = [head, "|---|---|---|" + "---|" * (4 * len(programs))]
  for m in models:
    for tok in tokens:
      for t in topologies:
        cells = []
        for prog in programs:
          for r in (rank, 0):
            row = by.get((m, tok, t, prog, r))
            if row is None:
              cells += ["n/c", "n/c"]
              continue
            p = row["plan"]["programs"][prog]
            mark = "" if row["layers"] == "0" else " (x)"
            cells += [f"{gib(state_bytes(p))} GiB", peak_cell(row["plan"], prog) + mark]
        lines.append(f"| Qwen2.5-{m.upper()} | {tok // 1024}k | {t} ({parse_chips(t)} chips) | "
                     + " | ".join(cells) + " |")
  return "\n".join(lines)


def parse_chips(topology: str) -> int:
  from rljax.plan.topology import parse_topology
  return parse_topology(topology).chips


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="1.5b,7b,14b,32b")
  p.add_argument("--tokens", default="4096,16384,32768")
  p.add_argument("--topologies", default="v5p-8,v5p-32")
  p.add_argument("--programs", default="learner")
  p.add_argument("--layers", default="0", help="0: full depth; A,B: compile at A and B layers and extrapolate")
  p.add_argument("--out", default=os.path.join("runs", "plan_table.jsonl"))
  p.add_argument("--render-only", action="store_true", help="compile nothing; print the table from --out")
  p.add_argument("--lora-rank", type=int, default=0,
                 help="R > 0: compile every cell as a LoRA run of rank R (all 7 projections) and as full "
                      "fine-tuning, and print the comparison table")
  args = p.parse_args()
  os.chdir(ROOT)
  sys.path.insert(0, ROOT)
  from rljax.plan.topology import parse_topology
  models = args.models.split(",")
  tokens = [int(t) for t in args.tokens.split(",")]
  topologies = args.topologies.split(",")
  done: list[dict] = []
  if os.path.exists(args.out):
    with open(args.out) as f:
      done = [json.loads(line) for line in f if line.strip()]
  have = {key(r) for r in done}
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  ranks = (args.lora_rank, 0) if args.lora_rank else (0,)
  for m in models:
    for tok in tokens:
      for t in topologies:
        for prog in args.programs.split(","):
          for rank in ranks:
            if args.render_only or (m, tok, t, prog, rank) in have:
              continue
            argv = cell_argv(m, tok, t, parse_topology(t).chips, prog, args.layers, rank)
            t0 = time.perf_counter()
            plan = run_cell(argv)
            row = {"model": m, "tokens": tok, "topology": t, "program": prog, "lora_rank": rank,
                   "layers": args.layers, "seconds": round(time.perf_counter() - t0, 1), "argv": argv, "plan": plan}
            done.append(row)
            with open(args.out, "a") as f:
              f.write(json.dumps(row) + "\n")
            pr = plan["programs"][prog]
            print(f"{m:>5} {tok:>6} {t:>7} {prog:>8} lora={rank:<3}: peak {gib(pr['peak_bytes'])} GiB "
                  f"state {gib(state_bytes(pr))} GiB fits={pr['fits']} compile {pr['compile_s']:.0f} s",
                  file=sys.stderr, flush=True)
  if args.lora_rank:
    print(render_lora(done, models, tokens, topologies, args.programs.split(","), args.lora_rank))
  else:
    print(render([r for r in done if r.get("lora_rank", 0) == 0], models, tokens, topologies,
                 args.programs.split(",")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
