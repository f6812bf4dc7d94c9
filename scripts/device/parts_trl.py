"""Device check part `trl_grpo`: one GRPO step of rljax against TRL's GRPOTrainer (its vLLM-free path)
on the same random-weight model, prompts and work, each side in its own process.

The work (scripts/bench_step.py's, at GPU sizes): a random-weight model of Qwen2.5-0.5B's shape
saved as a Hugging Face directory with a word-level tokenizer (both sides load that directory),
P prompts of exactly W words x G completions of exactly T tokens (EOS ignored: rljax
`sampling.ignore_eos`, TRL `min_new_tokens`), temperature 1, the smoke recipe's `vowels` reward,
GRPO without KL, one AdamW step per rollout, bf16 compute over fp32 parameters (TRL: `bf16=True`,
autocast), activations recomputed in the backward pass on both sides (rljax `model.remat`, TRL
`gradient_checkpointing`). Seconds per step: the median after the first (compile / warm-up) step.

Options: trl_prompts (8), trl_group (8), trl_words (32), trl_new_tokens (128), trl_steps (3).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from checklib import GIB, MODEL_CONFIGS, Context, Recorder, median, word_prompts, write_word_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


def _settings(ctx: Context) -> dict:
  d = (dict(prompts=2, group=4, words=8, new_tokens=8, steps=2) if ctx.cpu else
       dict(prompts=8, group=8, words=32, new_tokens=128, steps=3))
  return {k: int(ctx.options.get(f"trl_{k}", v)) for k, v in d.items()}


def _hf_config(cpu: bool):
  import transformers
  if cpu:
    return transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=3)
  with open(os.path.join(MODEL_CONFIGS, "qwen2.5-0.5b", "config.json"), encoding="utf-8") as f:
    raw = json.load(f)
  raw.update(bos_token_id=1, eos_token_id=2, pad_token_id=3)   # the word tokenizer's specials
  return transformers.Qwen2Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})


def trl_grpo(rec: Recorder, ctx: Context) -> None:
  check = "GRPO step: rljax vs TRL GRPOTrainer"
  rec.guarded(check, lambda: _compare(rec, ctx, check))


def _compare(rec: Recorder, ctx: Context, check: str) -> None:
  try:
    import datasets  # noqa: F401
    import torch
    import transformers
    import trl
  except ImportError as e:
    rec.row(check, "skipped", note=f"{e.name} is not installed here (scripts/device/fetch_wheels.sh carries "
                                   "trl and datasets to the GPU machine)")
    return
  s = _settings(ctx)
  work = os.path.join(ctx.work_dir, "trl")
  model_dir = os.path.join(work, "model")
  config = _hf_config(ctx.cpu)
  write_word_tokenizer(model_dir, config.vocab_size)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(model_dir)
  del model
  prompts = word_prompts(s["prompts"] * s["steps"], s["words"], config.vocab_size)
  data = os.path.join(work, "prompts.jsonl")
  with open(data, "w", encoding="utf-8") as f:
    for p in prompts:
      f.write(json.dumps({"prompt": p, "answer": "0"}) + "\n")
  job = dict(s, model_dir=model_dir, data=data, out=work, cpu=ctx.cpu)
  results = {}
  for side in ("rljax", "trl"):
    budget = ctx.seconds_left() - 5 if side == "trl" else (ctx.seconds_left() - 5) * 0.5
    t0 = time.time()
    try:
      out = subprocess.run([sys.executable, os.path.abspath(__file__), side, json.dumps(job)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=max(budget, 1), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
      text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
      sys.stdout.write(text[-6000:])
      raise RuntimeError(f"the {side} side did not finish in {budget:.0f} s") from None
    sys.stdout.write(out.stdout[-6000:])
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
      raise RuntimeError(f"the {side} side exited {out.returncode} after {time.time() - t0:.0f} s: "
                         f"{(out.stdout.strip().splitlines() or [''])[-1][:300]}")
    results[side] = json.loads(lines[-1][len("RESULT "):])
  r, t = results["rljax"], results["trl"]
  values = {"rljax_step_s": r["step_s"], "trl_step_s": t["step_s"], "speedup": t["step_s"] / r["step_s"],
            "rljax_sample_s": r["sample_s"], "rljax_update_s": r["update_s"],
            "rljax_first_step_s": r["first_step_s"], "trl_first_step_s": t["first_step_s"],
            "rljax_tokens_per_step": r["tokens_per_step"], "trl_tokens_per_step": t["tokens_per_step"]}
  for side, res in results.items():
    if res.get("peak_gib") is not None:
      values[f"{side}_peak_gib"] = res["peak_gib"]
  rows = s["prompts"] * s["group"]
  same_work = (r["tokens_per_step"] == t["tokens_per_step"] == rows * s["new_tokens"]
               and t["prompt_tokens"] == [s["words"]])
  rec.row(check, "ok" if same_work else "fail", values,
          f"{'tiny stand-in' if ctx.cpu else 'Qwen2.5-0.5B shapes'}, random weights, {s['prompts']} prompts x G="
          f"{s['group']} x {s['new_tokens']} tokens ({rows} rows, {s['words']}-token prompts); median of "
          f"{s['steps'] - 1} steps after the first; trl {trl.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}" + ("" if same_work else "; the sides generated different token counts"))


# ---- the two sides, each in its own process ------------------------------------------------------


def rljax_config(job: dict):
  """The rljax side's run config: the smoke recipe's `vowels` reward on the job's prompts and model."""
  from rljax.config_overrides import apply_overrides, load_config_file
  cfg = load_config_file(os.path.join(ROOT, "rljax", "configs", "smoke.py"))
  # the prompts are only text to continue: the `vowels` component scores every row, so no source verifier
  cfg.data.sources = [dict(kind="jsonl", path=job["data"], verifier="none", weight=1.0)]
  apply_overrides(cfg, [
      f"model.path={job['model_dir']!r}", f"tokenizer={job['model_dir']!r}",
      f"model.dtype={'float32' if job['cpu'] else 'bfloat16'!r}", "model.remat=True", "data.chat_template=False",
      "data.shuffle=False", f"data.max_prompt_tokens={job['words']}", f"train.prompts_per_step={job['prompts']}",
      f"sampling.num_samples={job['group']}", f"sampling.max_new_tokens={job['new_tokens']}",
      "sampling.ignore_eos=True", "sampling.temperature=1.0", "optim.learning_rate=1e-6", "rl.kl_coef=0.0",
      f"train.steps={job['steps']}", f"output.dir={os.path.join(job['out'], 'rljax-run')!r}",
      "output.progress=False", "output.tensorboard=False", "checkpoint.every=0", "checkpoint.resume=False"])
  return cfg


def run_rljax(job: dict) -> dict:
  import jax

  from rljax.trainer.loop import Trainer
  cfg = rljax_config(job)
  trainer = Trainer(cfg)
  steps = []
  try:
    for _ in range(job["steps"]):
      m = trainer.run_step()
      steps.append({k: m[f"time/{k}"] for k in ("step", "sample", "update")})
      steps[-1]["tokens"] = m["sampler/tokens"]
  finally:
    trainer.close()
  stats = jax.devices()[0].memory_stats() or {}
  later = steps[1:] or steps
  return {"step_s": median([x["step"] for x in later]), "sample_s": median([x["sample"] for x in later]),
          "update_s": median([x["update"] for x in later]), "first_step_s": steps[0]["step"],
          "tokens_per_step": median([x["tokens"] for x in steps]),
          "peak_gib": stats["peak_bytes_in_use"] / GIB if "peak_bytes_in_use" in stats else None}


def run_trl(job: dict) -> dict:
  import datasets
  import torch
  import transformers
  import trl

  from rljax.configs.smoke import vowel_fraction

  def vowels(completions, **_):
    return [vowel_fraction(c if isinstance(c, str) else c[0]["content"], None) for c in completions]

  with open(job["data"], encoding="utf-8") as f:
    rows = [{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()]
  times: list[float] = []
  tokens: list[float] = []

  class StepTimer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.start)

    def on_log(self, args, state, control, logs=None, **kw):
      if logs and "completions/mean_length" in logs:
        tokens.append(logs["completions/mean_length"] * job["prompts"] * job["group"])

  # The tokenizer.json itself: AutoTokenizer would pick Qwen2's tokenizer class from config.json and
  # split the prompts differently (127 tokens for a 32-word prompt, in transformers 5.24).
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=os.path.join(job["model_dir"], "tokenizer.json"), unk_token="<unk>", bos_token="<s>",
      eos_token="</s>", pad_token="<pad>", padding_side="left")
  prompt_tokens = sorted({len(tok(r["prompt"]).input_ids) for r in rows})
  args = trl.GRPOConfig(
      output_dir=os.path.join(job["out"], "trl-run"), per_device_train_batch_size=job["prompts"] * job["group"],
      gradient_accumulation_steps=1, num_generations=job["group"], max_completion_length=job["new_tokens"],
      generation_kwargs={"min_new_tokens": job["new_tokens"]}, temperature=1.0, top_p=1.0, top_k=0,
      learning_rate=1e-6, beta=0.0, loss_type="grpo", num_iterations=1, max_steps=job["steps"], logging_steps=1,
      save_strategy="no", report_to="none", use_cpu=job["cpu"], bf16=not job["cpu"], gradient_checkpointing=True,
      shuffle_dataset=False, disable_tqdm=True, seed=0)
  trainer = trl.GRPOTrainer(
      model=transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32),
      processing_class=tok,
      reward_funcs=vowels, args=args, train_dataset=datasets.Dataset.from_list(rows), callbacks=[StepTimer()])
  trainer.train()
  later = times[1:] or times
  peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() and not job["cpu"] else None
  return {"step_s": median(later), "first_step_s": times[0] if times else float("nan"), "peak_gib": peak,
          "tokens_per_step": median(tokens), "prompt_tokens": prompt_tokens}


if __name__ == "__main__":
  side, job = sys.argv[1], json.loads(sys.argv[2])
  print("RESULT " + json.dumps(run_rljax(job) if side == "rljax" else run_trl(job)), flush=True)
