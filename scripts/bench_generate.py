"""Benchmark: rljax's in-graph sampler against transformers `generate`, in the same run.

SmolLM2-135M-Instruct (the built-in model), 8 chat prompts x G=8 completions, 128 new tokens,
sampled at temperature 1.0 with no truncation, float32 on this machine's CPU. Both sides use the
same weights, the same prompts and the same settings, and make exactly 128 tokens per completion
(stop tokens are disabled on both sides so the work is identical).

Prints rljax tokens/s, transformers tokens/s, their ratio, and the fraction of the compute roofline:
roofline tokens/s = measured fp32 matmul peak (FLOP/s) / (2 * parameter count).

  python scripts/bench_generate.py [--prompts 8] [--samples 8] [--new-tokens 128] [--repeats 2]
                                   [--top-p 1.0] [--top-k 0] [--skip-hf]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchlib import Result, add_json_arg, report  # noqa: E402

import rljax  # noqa: E402
from rljax.flops import matmul_peak as measured_matmul_peak  # noqa: E402
from rljax.rollout import SamplingParams, generate  # noqa: E402

QUESTIONS = [
    "What is 17 + 25? Answer with just the number.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a prime number is.",
    "What is the capital of France?",
    "Give me a short tip for learning to cook.",
    "What is 9 times 7?",
    "Describe a cat in two sentences.",
    "List four fruits that are red.",
    "Why is the sky blue? Keep it brief.",
    "Translate 'good morning' into Spanish.",
    "What comes after Tuesday?",
    "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
    "Write one sentence about autumn.",
    "What is 100 minus 37?",
]


def build_prompts(policy, num_prompts: int) -> list[list[int]]:
  tok = policy.tokenizer
  out = []
  for i in range(num_prompts):
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    out.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
  return out


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  width = max(len(p) for p in prompts)
  ids = np.full((len(prompts), width), pad_id, np.int64)
  mask = np.zeros((len(prompts), width), np.int64)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = p
    mask[i, width - len(p):] = 1
  return ids, mask


def run_rljax(policy, ids, mask, sp: SamplingParams, seed: int):
  """Seconds and generated tokens of one `generate` call."""
  t = time.perf_counter()
  out = generate(policy, ids, sp, jax.random.key(seed), prompt_mask=mask, eos_ids=())
  jax.block_until_ready(out)
  return time.perf_counter() - t, int(np.asarray(out.lengths).sum()), out


def hf_model(policy):
  import torch
  import transformers

  from rljax.models.convert import params_to_hf
  hf_cfg = transformers.AutoConfig.for_model(**policy.config.to_hf())
  model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
  tensors = {k: torch.from_numpy(v) for k, v in params_to_hf(policy.config, policy.params).items()}
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  if unexpected or [m for m in missing if m != "lm_head.weight"]:
    raise RuntimeError(f"weights did not load into transformers: missing={missing} unexpected={unexpected}")
  model.tie_weights()
  model.generation_config.eos_token_id = None
  return model


def hf_kwargs(sp: SamplingParams) -> dict:
  return dict(do_sample=True, temperature=sp.temperature, top_k=sp.top_k or None, top_p=sp.top_p,
              max_new_tokens=sp.max_new_tokens, min_new_tokens=sp.max_new_tokens,
              num_return_sequences=sp.num_samples, eos_token_id=None, pad_token_id=0)


def run_hf(model, ids, mask, sp: SamplingParams, seed: int):
  """Seconds and generated tokens of one transformers `generate` call (HF repeats each prompt G times)."""
  import torch
  torch.manual_seed(seed)
  with torch.inference_mode():
    t = time.perf_counter()
    out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **hf_kwargs(sp))
    dt = time.perf_counter() - t
  return dt, int((out.shape[1] - ids.shape[1]) * out.shape[0])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--top-k", type=int, default=0)
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--repeats", type=int, default=2, help="timed runs per side, alternating (best and median reported)")
  ap.add_argument("--skip-hf", action="store_true")
  add_json_arg(ap)
  args = ap.parse_args(argv)

  policy = rljax.load_pretrained(args.model)
  cfg = policy.config
  sp = SamplingParams(num_samples=args.samples, max_new_tokens=args.new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p)
  prompts = build_prompts(policy, args.prompts)
  ids, mask = left_pad(prompts, cfg.pad_token_id or 0)
  rows = args.prompts * args.samples
  print(f"model {args.model}: {cfg.num_params / 1e6:.1f}M params, {cfg.num_layers} layers, dtype {cfg.dtype}; "
        f"{jax.device_count()} x {jax.devices()[0].platform}, {os.cpu_count()} CPU cores")
  print(f"work: {args.prompts} prompts (width {ids.shape[1]}, lengths {min(map(len, prompts))}-"
        f"{max(map(len, prompts))}) x G={args.samples} = {rows} rows x {args.new_tokens} new tokens; "
        f"temperature {sp.temperature}, top_k {sp.top_k}, top_p {sp.top_p}; stop tokens off")
  slots = args.prompts * ids.shape[1] + rows * args.new_tokens
  kv_bytes = 2 * cfg.num_layers * slots * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
  print(f"KV caches: 2 * L * K * Dh * (P * Lp + P * G * T) * bytes = {kv_bytes / 2**20:.0f} MiB")

  peak = measured_matmul_peak(2048, iters=6, reduce=min)
  print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")

  t, _, _ = run_rljax(policy, ids, mask, sp, 0)
  print(f"rljax first call (compile + run): {t:.1f} s")
  model = None
  if not args.skip_hf:
    import torch
    import transformers
    model = hf_model(policy)
    run_hf(model, ids[:1], mask[:1], SamplingParams(1, 2), 0)  # warm-up
    print(f"transformers {transformers.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
  # rljax and transformers runs alternate, so load from other processes on this shared machine
  # hits both sides alike; each pair gives a ratio.
  rl, hf, ratios = [], [], []
  for r in range(args.repeats):
    t, n, out = run_rljax(policy, ids, mask, sp, r + 1)
    rl.append(n / t)
    line = f"run {r + 1}: rljax {n} tokens in {t:.1f} s = {n / t:.1f} tokens/s"
    if model is not None:
      t, hn = run_hf(model, ids, mask, sp, r + 1)
      hf.append(hn / t)
      ratios.append(rl[-1] / hf[-1])
      line += f"; transformers {hn} tokens in {t:.1f} s = {hn / t:.1f} tokens/s; ratio {ratios[-1]:.2f}x"
    print(line, flush=True)
  peak = max(peak, measured_matmul_peak(2048, iters=6, reduce=min))
  roofline = peak / (2 * cfg.num_params)
  text = policy.tokenizer.decode(np.asarray(out.tokens[0])) if policy.tokenizer is not None else ""
  print(f"rljax sample completion: {text[:120]!r}")
  print(f"rljax: {max(rl):.1f} tokens/s (best), {statistics.median(rl):.1f} (median)")
  if hf:
    print(f"transformers: {max(hf):.1f} tokens/s (best), {statistics.median(hf):.1f} (median)")
    print(f"ratio rljax / transformers: {max(rl) / max(hf):.2f}x (best vs best), {statistics.median(ratios):.2f}x "
          "(median of paired runs)")
  print(f"roofline: {peak / 1e9:.1f} GFLOP/s (best measured) / (2 x {cfg.num_params / 1e6:.1f}M) = {roofline:.0f} "
        f"tokens/s; rljax at {max(rl) / roofline:.0%} of it")
  work = f"sampler, {args.prompts} prompts x G={args.samples} x {args.new_tokens} tokens"
  results = [Result(f"{work}: tokens/s (best of {args.repeats})", f"{max(rl):.0f}",
                    f"transformers generate {max(hf):.0f}" if hf else "-",
                    f"{max(rl) / max(hf):.2f}x faster" if hf else "-"),
             Result(f"{work}: fraction of the compute roofline ({roofline:.0f} tokens/s)", f"{max(rl) / roofline:.0%}")]
  return report(results, args.json)


if __name__ == "__main__":
  main()
