"""One full GRPO step (sample, score, update): rljax vs TRL's GRPOTrainer on the same work.

    python scripts/bench_step.py                      # 1 warm-up + 3 measured steps per side
    python scripts/bench_step.py --steps 5 --skip-trl
    python scripts/bench_step.py --natural            # EOS honoured on every side; rljax packs its update

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

Tunix (`google-tunix`, its GRPOLearner on its Llama 3 model code with the `vanilla` rollout
engine) runs with `--tunix-python`, a Python from a venv where google-tunix is installed (it pins
other transformers and flax versions than rljax's). Its step time is the interval between
consecutive reward calls (it has no step callback), so one extra step is run.

With `--natural`, every side honours EOS (the same prompts, the same 128-token cap), so completions
have their natural, ragged lengths; rljax then packs its update (`train.pack_tokens`, blocks of
`--pack-rows` rows' width of real tokens, default 4, instead of 4 padded micro-batches of 16 rows: a
short last block wastes less) in bins of `--bin-rows` rows' width (`train.pack_width`, default 2) and
the report adds the update's trained, real, computed and padded positions. The packed update computes
each prompt once per chunk of its group's completions (`train.shared_prefix`, trainer/packing.py;
`--no-shared-prefix` packs every row with its own prompt copy, the earlier layout: the 48-token prompts
were then about half of the computed positions). `--remat off` runs rljax without
rematerialisation (the default recipe's `model.remat=True` is kept otherwise). It also decodes with 16
decode slots for the 64 rows (`sampling.slots`, continuous batching, docs/sampling.md; `--slots N` to change,
0 = one slot per row): natural lengths here are long-tailed
(mean ~34 of 128, a few truncated), and on SmolLM2-135M with these prompts 16 slots generated the same samples
1.55-1.75x faster than one slot per row, 32 slots 1.4-1.5x (this CPU, loaded; two interleaved rounds). The
report gives the sampler's slot utilisation (tokens made / decode slots x decode steps) and decode steps.

Prints seconds per step (median of the measured steps, warm-up excluded), generated tokens/s,
peak RSS, and the ratios rljax / peer.
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


def run_rljax(hf_dir: str, steps: int, work_dir: str, natural: bool = False, pack_rows: int = 4,
              slots: int = 0, shared_prefix: bool = True, bin_rows: int = 2, remat: bool = True) -> dict:
  """The embedded default recipe, resized to the benchmark's work."""
  from rljax.config_overrides import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  cfg = load_config_file(os.path.join(ROOT, "rljax", "configs", "default.py"))
  apply_overrides(cfg, [
      f"model.path={hf_dir!r}", f"output.dir={os.path.join(work_dir, 'rljax')!r}",
      f"train.prompts_per_step={PROMPTS}", f"sampling.num_samples={GROUP}",
      f"sampling.max_new_tokens={NEW_TOKENS}", f"sampling.ignore_eos={not natural}", "sampling.temperature=1.0",
      f"train.steps={steps}", "eval.before_and_after=False", "output.export_hf=False", f"sampling.slots={slots}",
      "output.progress=False", "output.tensorboard=False", "checkpoint.every=0", "checkpoint.resume=False",
      f"model.remat={remat}",
  ])
  width = cfg.data.max_prompt_tokens + NEW_TOKENS
  apply_overrides(cfg, [f"train.pack_tokens={pack_rows * width}", f"train.shared_prefix={shared_prefix}",
                        f"train.pack_width={bin_rows * width}"] if natural else ["train.micro_batches=4"])
  trainer = Trainer(cfg)
  prompts: list[dict] = []
  set_batch = trainer.scorer.reward_fn.set_batch

  def recording_set_batch(examples, *args, **kwargs):  # the benchmark replays these prompts in TRL
    per_prompt = examples if len(examples) == PROMPTS else examples[::GROUP]
    prompts.extend({"messages": list(e["prompt_messages"]), "answer": e["answer"]} for e in per_prompt)
    return set_batch(examples, *args, **kwargs)

  trainer.scorer.reward_fn.set_batch = recording_set_batch
  steps_out = []
  for _ in range(steps):
    m = trainer.run_step()
    steps_out.append({"seconds": m["time/step"], "tokens": m["sampler/tokens"], "sample": m["time/sample"],
                      "score": m["time/score"], "update": m["time/update"], "reward": m["reward/mean"],
                      "update_mfu": m.get("perf/update_mfu", 0.0), "sample_mfu": m.get("perf/sample_mfu", 0.0),
                      "real_tokens": m.get("num_tokens", 0.0), "packed_tokens": m.get("packed_tokens", 0.0),
                      "packed_real_tokens": m.get("packed_real_tokens", 0.0),
                      "padded_tokens": m.get("padded_tokens", 0.0),
                      "slot_utilisation": m.get("sampler/slot_utilisation", 0.0),
                      "decode_steps": m.get("sampler/decode_steps", 0.0)})
  trainer.scorer.pool.close()
  return {"steps": steps_out, "prompts": prompts, "peak_rss_gib": peak_rss_gib()}


def run_trl(hf_dir: str, steps: int, work_dir: str, prompts: list[dict], natural: bool = False) -> dict:
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
      generation_kwargs={} if natural else {"min_new_tokens": NEW_TOKENS}, temperature=1.0, top_p=1.0, top_k=0,
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


def run_tunix(hf_dir: str, steps: int, work_dir: str, prompts: list[dict]) -> dict:
  """Tunix's GRPO learner on its Llama 3 model code (SmolLM2 is a Llama), vanilla rollout engine."""
  import jax
  import optax
  import transformers
  from tunix.models.llama3 import model as llama, params as llama_params
  from tunix.rl import rl_cluster as rlc
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  from rljax.rewards.verifiers.arith import arithmetic_verifier

  with open(os.path.join(hf_dir, "config.json")) as f:
    hf = json.load(f)
  cfg = llama.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], weight_tying=hf.get("tie_word_embeddings", False))
  auto = jax.sharding.AxisType.Auto  # Tunix's models expect auto-sharded meshes (make_mesh defaults to Explicit)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto))
  with mesh:  # Tunix's own examples load under the (deprecated) mesh context; jax.set_mesh breaks its gathers
    model = llama_params.create_model_from_safe_tensors(hf_dir, cfg, mesh)
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  stamps: list[float] = []

  def correct(prompts, completions, answer, **_):
    stamps.append(time.perf_counter())  # once per step, after its rollout: the intervals are step times
    return [arithmetic_verifier(c, {"answer": a}).score for c, a in zip(completions, answer)]

  cluster = rlc.RLCluster(
      actor=model, tokenizer=tokenizer,
      cluster_config=rlc.ClusterConfig(
          role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False,
          training_config=rlc.RLTrainingConfig(
              actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**6, max_steps=steps + 1,
              mini_batch_size=PROMPTS, train_micro_batch_size=2, rollout_micro_batch_size=PROMPTS,
              compute_logps_micro_batch_size=2),
          rollout_config=base_rollout.RolloutConfig(
              max_tokens_to_generate=NEW_TOKENS, max_prompt_length=64, kv_cache_size=64 + NEW_TOKENS + 8,
              temperature=1.0, top_p=1.0, top_k=None, eos_tokens=[-1])))  # -1: no stop token, as on the other sides
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=correct,
      algo_config=grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0, epsilon=0.2))
  texts = [tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True) for p in prompts]
  batches = [{"prompts": texts[i:i + PROMPTS], "answer": [p["answer"] for p in prompts[i:i + PROMPTS]]}
             for i in range(0, len(texts), PROMPTS)]
  batches.append(batches[-1])  # one more step than measured: its rollout closes the last interval
  learner.train(batches)
  intervals = [b - a for a, b in zip(stamps, stamps[1:])]
  return {"steps": [{"seconds": s, "tokens": PROMPTS * GROUP * NEW_TOKENS} for s in intervals],
          "peak_rss_gib": peak_rss_gib(), "versions": f"google-tunix, jax {jax.__version__}"}


def _child(side: str, hf_dir: str, steps: int, work_dir: str, python: str = sys.executable,
           natural: bool = False, pack_rows: int = 4, slots: int = 0, shared_prefix: bool = True,
           bin_rows: int = 2, remat: bool = True) -> dict:
  out = os.path.join(work_dir, f"{side}.json")
  cmd = [python, os.path.abspath(__file__), "--side", side, "--hf-dir", hf_dir, "--steps", str(steps),
         "--work-dir", work_dir, "--slots", str(slots)]
  cmd += ["--natural", "--pack-rows", str(pack_rows), "--bin-rows", str(bin_rows)] if natural else []
  cmd += [] if shared_prefix else ["--no-shared-prefix"]
  cmd += ["--remat", "on" if remat else "off"]
  subprocess.run(cmd, check=True)
  with open(out) as f:
    return json.load(f)


def summarise(name: str, result: dict, warmup: int) -> dict:
  measured = result["steps"][warmup:]
  seconds = statistics.median(s["seconds"] for s in measured)
  tokens = statistics.median(s["tokens"] for s in measured)
  row = {"side": name, "s_per_step": seconds, "tokens_per_s": tokens / seconds, "peak_rss_gib": result["peak_rss_gib"]}
  for phase in ("sample", "score", "update", "update_mfu", "sample_mfu", "real_tokens", "packed_tokens",
                "packed_real_tokens", "padded_tokens", "slot_utilisation", "decode_steps"):
    if phase in measured[0]:
      row[phase] = statistics.median(s[phase] for s in measured)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=3, help="measured steps per side (median reported)")
  p.add_argument("--warmup", type=int, default=1, help="steps excluded from the figures (compilation, caches)")
  p.add_argument("--skip-trl", action="store_true")
  p.add_argument("--natural", action="store_true", help="honour EOS on every side; rljax packs its update")
  p.add_argument("--pack-rows", type=int, default=4, help="with --natural: rljax's packed block, in rows' widths")
  p.add_argument("--remat", choices=["on", "off"], default="on",
                 help="rljax's model.remat (default on, the default recipe's)")
  p.add_argument("--bin-rows", type=int, default=2,
                 help="with --natural: rljax's packed bins' width (train.pack_width), in rows' widths")
  p.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                 help="with --natural: pack every row with its own prompt copy (train.shared_prefix=False)")
  p.add_argument("--slots", type=int, default=None,
                 help="rljax's sampling.slots (decode slots, continuous batching; 0 = one per row); default 16 with "
                      "--natural, else 0 (every row runs to the budget)")
  add_json_arg(p)
  p.add_argument("--tunix-python", default="",
                 help="a Python with google-tunix installed (its own venv: it pins other transformers/flax)")
  p.add_argument("--side", choices=["rljax", "trl", "tunix"], help=argparse.SUPPRESS)
  p.add_argument("--hf-dir", help=argparse.SUPPRESS)
  p.add_argument("--work-dir", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.slots is None:
    args.slots = 16 if args.natural else 0

  if args.side:  # a child process: run one side and write its figures
    if args.side == "rljax":
      result = run_rljax(args.hf_dir, args.steps, args.work_dir, args.natural, args.pack_rows, args.slots,
                         args.shared_prefix, args.bin_rows, args.remat == "on")
    else:
      with open(os.path.join(args.work_dir, "rljax.json")) as f:
        prompts = json.load(f)["prompts"]
      if args.side == "trl":
        result = run_trl(args.hf_dir, args.steps, args.work_dir, prompts, args.natural)
      else:
        result = run_tunix(args.hf_dir, args.steps, args.work_dir, prompts)
    with open(os.path.join(args.work_dir, f"{args.side}.json"), "w") as f:
      json.dump(result, f)
    return None

  total = args.warmup + args.steps
  with tempfile.TemporaryDirectory() as work:
    hf_dir = export_model(os.path.join(work, "smollm2-hf"))
    rows = [summarise("rljax", _child("rljax", hf_dir, total, work, natural=args.natural, pack_rows=args.pack_rows,
                                      slots=args.slots, shared_prefix=args.shared_prefix, bin_rows=args.bin_rows,
                                      remat=args.remat == "on"),
                          args.warmup)]
    if not args.skip_trl:
      trl_result = _child("trl", hf_dir, total, work, natural=args.natural)
      rows.append(summarise("TRL GRPOTrainer", trl_result, args.warmup))
      print(f"peer: {trl_result['versions']}")
    if args.tunix_python:
      tunix_result = _child("tunix", hf_dir, total, work, python=args.tunix_python)
      rows.append(summarise("Tunix GRPOLearner", tunix_result, args.warmup))
  print(f"work: {PROMPTS} prompts x G={GROUP} x {'at most ' if args.natural else ''}{NEW_TOKENS} new tokens per "
        f"step, SmolLM2-135M float32; median of {args.steps} steps after {args.warmup} warm-up")
  r, peers = rows[0], rows[1:]
  work = f"GRPO step, {PROMPTS} prompts x G={GROUP} x {'<= ' if args.natural else ''}{NEW_TOKENS} tokens"
  results = [Result(f"{work}: seconds per step", f"{r['s_per_step']:.1f} s (sample {r['sample']:.1f}, score "
                    f"{r['score']:.2f}, update {r['update']:.1f})")]
  results += [Result(f"{work}: seconds per step", "", f"{q['side']} {q['s_per_step']:.1f} s",
                     f"{q['s_per_step'] / r['s_per_step']:.2f}x faster") for q in peers]
  results.append(Result(f"{work}: update phase, fraction of measured matmul peak", f"{r['update_mfu']:.0%}"))
  if args.natural:
    results.append(Result(f"{work}: update positions (trained completion tokens / real: prompt copies + "
                          "completions / computed in packed blocks / padded rows)",
                          f"{r['real_tokens']:.0f} / {r['packed_real_tokens']:.0f} / {r['packed_tokens']:.0f} / "
                          f"{r['padded_tokens']:.0f}"))
  slots = args.slots or PROMPTS * GROUP
  results.append(Result(f"{work}: sampler slot utilisation ({slots} decode slots, {r['decode_steps']:.0f} decode "
                        "steps; tokens made / slots x steps)", f"{r['slot_utilisation']:.0%}"))
  for q in peers:
    results.append(Result(f"{work}: peak RSS", f"{r['peak_rss_gib']:.1f} GiB", f"{q['side']} {q['peak_rss_gib']:.1f} "
                                                                               f"GiB",
                          f"{r['peak_rss_gib'] / q['peak_rss_gib']:.2f}x the memory"))
  return report(results, args.json)


if __name__ == "__main__":
  main()
