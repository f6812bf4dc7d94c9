"""One full GRPO step (sample, score, update): rljax vs TRL's GRPOTrainer on the same work.

    python scripts/bench_step.py                      # 1 warm-up + 3 measured steps per side
    python scripts/bench_step.py --steps 5 --skip-trl

The work, identical on both sides: SmolLM2-135M-Instruct exported to a Hugging Face directory
(both sides load that directory), 8 arithmetic prompts per step x G = 8 completions, 128 new
tokens in every completion (EOS ignored: rljax `sampling.ignore_eos`, TRL
`min_new_tokens=128`), temperature 1, the `arithmetic` verifier, GRPO loss without KL (no
reference model), AdamW, one optimizer step per rollout batch, float32, this machine's CPU.
Both sides train on the same prompts in the same order: the rljax run records the prompts it
drew and the TRL run replays them.

Memory strategy, each side's own: rljax accumulates gradients over 4 micro-batches of 2 prompt
groups (the whole batch at once needs ~25 GB of activations); TRL keeps its default gradient
checkpointing. Each side runs in its own subprocess so its peak memory (max RSS) is its own. TRL runs with
torch's default threads (one per core) and without vLLM (which has no CPU path here).

Tunix (`google-tunix`) is not benchmarked: see the Performance section of the README for why.
Prints seconds per step (median of the measured steps, warm-up excluded), generated tokens/s,
peak RSS, and the ratios rljax / TRL.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import Result, add_json_arg, report  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS = 8, 8, 128


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def export_model(out_dir: str) -> str:
  import rljax
  policy = rljax.load_pretrained("smollm2-135m-instruct")
  return rljax.save_pretrained(policy, out_dir)


def run_rljax(hf_dir: str, steps: int, work_dir: str) -> dict:
  """The embedded default recipe, resized to the benchmark's work."""
  from rljax.config_overrides import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  cfg = load_config_file(os.path.join(ROOT, "rljax", "configs", "default.py"))
  apply_overrides(cfg, [
      f"model.path={hf_dir!r}", f"output.dir={os.path.join(work_dir, 'rljax')!r}",
      f"train.prompts_per_step={PROMPTS}", f"sampling.num_samples={GROUP}",
      f"sampling.max_new_tokens={NEW_TOKENS}", "sampling.ignore_eos=True", "sampling.temperature=1.0",
      f"train.steps={steps}", "train.micro_batches=4", "eval.before_and_after=False", "output.export_hf=False",
      "output.progress=False", "output.tensorboard=False", "checkpoint.every=0", "checkpoint.resume=False",
  ])
  trainer = Trainer(cfg)
  prompts: list[dict] = []
  set_batch = trainer.reward_fn.set_batch

  def recording_set_batch(examples, step):  # the benchmark replays these prompts in TRL
    per_prompt = examples if len(examples) == PROMPTS else examples[::GROUP]
    prompts.extend({"messages": list(e["prompt_messages"]), "answer": e["answer"]} for e in per_prompt)
    return set_batch(examples, step=step)

  trainer.reward_fn.set_batch = recording_set_batch
  steps_out = []
  for _ in range(steps):
    m = trainer.run_step()
    steps_out.append({"seconds": m["time/step"], "tokens": m["response/tokens"], "sample": m["time/sample"],
                      "score": m["time/score"], "update": m["time/update"], "reward": m["reward/mean"],
                      "update_mfu": m.get("perf/update_mfu", 0.0), "sample_mfu": m.get("perf/sample_mfu", 0.0)})
  trainer.pool.close()
  return {"steps": steps_out, "prompts": prompts, "peak_rss_gib": peak_rss_gib()}


def run_trl(hf_dir: str, steps: int, work_dir: str, prompts: list[dict]) -> dict:
  import datasets
  import torch
  import transformers
  import trl

  from rljax.rewards.verifiers.arith import arithmetic_verifier

  def correct(completions, answer, **_):
    return [arithmetic_verifier(c[0]["content"], {"answer": a}).score for c, a in zip(completions, answer)]

  rows = [{"prompt": p["messages"], "answer": p["answer"]} for p in prompts]
  times: list[float] = []
  tokens: list[float] = []

  class StepTimer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.start)

    def on_log(self, args, state, control, logs=None, **kw):
      if logs and "completions/mean_length" in logs:
        tokens.append(logs["completions/mean_length"] * PROMPTS * GROUP)

  args = trl.GRPOConfig(
      output_dir=os.path.join(work_dir, "trl"), per_device_train_batch_size=PROMPTS * GROUP,
      gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=NEW_TOKENS,
      generation_kwargs={"min_new_tokens": NEW_TOKENS}, temperature=1.0, top_p=1.0, top_k=0,
      learning_rate=1e-5, beta=0.0, loss_type="grpo", num_iterations=1, max_steps=steps, logging_steps=1,
      save_strategy="no", report_to="none", use_cpu=True, bf16=False, shuffle_dataset=False,
      disable_tqdm=True, seed=0)
  trainer = trl.GRPOTrainer(
      model=transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
      processing_class=transformers.AutoTokenizer.from_pretrained(hf_dir, padding_side="left"),
      reward_funcs=correct, args=args, train_dataset=datasets.Dataset.from_list(rows), callbacks=[StepTimer()])
  trainer.train()
  return {"steps": [{"seconds": s, "tokens": t} for s, t in zip(times, tokens)], "peak_rss_gib": peak_rss_gib(),
          "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__} "
                      f"({torch.get_num_threads()} threads)"}


def _child(side: str, hf_dir: str, steps: int, work_dir: str) -> dict:
  out = os.path.join(work_dir, f"{side}.json")
  cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--hf-dir", hf_dir, "--steps", str(steps),
         "--work-dir", work_dir]
  subprocess.run(cmd, check=True)
  with open(out) as f:
    return json.load(f)


def summarise(name: str, result: dict, warmup: int) -> dict:
  measured = result["steps"][warmup:]
  seconds = statistics.median(s["seconds"] for s in measured)
  tokens = statistics.median(s["tokens"] for s in measured)
  row = {"side": name, "s_per_step": seconds, "tokens_per_s": tokens / seconds, "peak_rss_gib": result["peak_rss_gib"]}
  for phase in ("sample", "score", "update", "update_mfu", "sample_mfu"):
    if phase in measured[0]:
      row[phase] = statistics.median(s[phase] for s in measured)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=3, help="measured steps per side (median reported)")
  p.add_argument("--warmup", type=int, default=1, help="steps excluded from the figures (compilation, caches)")
  p.add_argument("--skip-trl", action="store_true")
  add_json_arg(p)
  p.add_argument("--side", choices=["rljax", "trl"], help=argparse.SUPPRESS)
  p.add_argument("--hf-dir", help=argparse.SUPPRESS)
  p.add_argument("--work-dir", help=argparse.SUPPRESS)
  args = p.parse_args(argv)

  if args.side:  # a child process: run one side and write its figures
    if args.side == "rljax":
      result = run_rljax(args.hf_dir, args.steps, args.work_dir)
    else:
      with open(os.path.join(args.work_dir, "rljax.json")) as f:
        result = run_trl(args.hf_dir, args.steps, args.work_dir, json.load(f)["prompts"])
    with open(os.path.join(args.work_dir, f"{args.side}.json"), "w") as f:
      json.dump(result, f)
    return None

  total = args.warmup + args.steps
  with tempfile.TemporaryDirectory() as work:
    hf_dir = export_model(os.path.join(work, "smollm2-hf"))
    rows = [summarise("rljax", _child("rljax", hf_dir, total, work), args.warmup)]
    if not args.skip_trl:
      trl_result = _child("trl", hf_dir, total, work)
      rows.append(summarise("TRL GRPOTrainer", trl_result, args.warmup))
      print(f"peer: {trl_result['versions']}")
  print(f"work: {PROMPTS} prompts x G={GROUP} x {NEW_TOKENS} new tokens per step, SmolLM2-135M float32; "
        f"median of {args.steps} steps after {args.warmup} warm-up")
  r = rows[0]
  peer = rows[1] if len(rows) == 2 else None
  work = f"GRPO step, {PROMPTS} prompts x G={GROUP} x {NEW_TOKENS} tokens"
  results = [
      Result(f"{work}: seconds per step", f"{r['s_per_step']:.1f} s (sample {r['sample']:.1f}, score "
             f"{r['score']:.2f}, update {r['update']:.1f})", f"TRL {peer['s_per_step']:.1f} s" if peer else "-",
             f"{peer['s_per_step'] / r['s_per_step']:.2f}x faster" if peer else "-"),
      Result(f"{work}: generated tokens/s over the step", f"{r['tokens_per_s']:.0f}",
             f"TRL {peer['tokens_per_s']:.0f}" if peer else "-",
             f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"),
      Result(f"{work}: peak RSS", f"{r['peak_rss_gib']:.1f} GiB", f"TRL {peer['peak_rss_gib']:.1f} GiB" if peer else "-",
             f"{r['peak_rss_gib'] / peer['peak_rss_gib']:.2f}x the memory" if peer else "-"),
      Result(f"{work}: update phase, fraction of measured matmul peak", f"{r['update_mfu']:.0%}"),
  ]
  return report(results, args.json)


if __name__ == "__main__":
  main()
