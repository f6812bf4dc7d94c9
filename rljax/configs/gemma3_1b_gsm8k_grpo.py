"""Gemma 3 1B (instruction-tuned, text-only) on GSM8K with GRPO (DeepSeekMath settings, KL 0.04 to
the initial policy).

  rljax train --config configs/gemma3_1b_gsm8k_grpo.py \
      --config.model.path=/path/to/gemma-3-1b-it \
      --config.data.sources='[{"kind": "gsm8k", "path": {"train": "/path/to/gsm8k/train.jsonl",
                                                         "test": "/path/to/gsm8k/test.jsonl"}}]'

model.path is a local copy of the Hugging Face checkpoint google/gemma-3-1b-it (config.json,
model.safetensors, tokenizer.json or tokenizer.model, tokenizer_config.json with the chat
template): a Gemma3ForCausalLM, which rljax loads as is (docs/models.md). Gemma's chat template
starts every prompt with <bos>, which the model needs, and <end_of_turn> ends a completion.
Gemma 3 alternates five sliding-window layers (512 tokens) with one global layer, so the learner
uses the xla or chunked attention (config.model.attention='auto' picks one of them).

The source names one file per split: training reads "train", the held-out evaluation (every
eval.every steps and before/after, which also picks the best checkpoint) reads "test". Sized for
one accelerator host (8 chips, data parallel); change mesh.shape for pods. Without the weights,
`rljax plan --config configs/gemma3_1b_gsm8k_grpo.py
--config.model.path=scripts/model_configs/gemma-3-1b` sizes the run from the model's shapes.
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "/path/to/gemma-3-1b-it"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.random.architecture = "gemma3"   # model.path="random" (tests, smoke runs) builds a tiny Gemma 3
  c.data.sources = [dict(kind="gsm8k", weight=1.0, verifier="gsm8k",
                         path=dict(train="/path/to/gsm8k/train.jsonl", test="/path/to/gsm8k/test.jsonl"))]
  c.data.system_prompt = "Please reason step by step, and put your final answer after '####'."
  c.data.max_prompt_tokens = 256
  c.sampling.num_samples = 8
  c.sampling.max_new_tokens = 512
  c.rl.preset = "grpo"                  # group mean/std, clip 0.2, seq-mean-token-mean, k3 KL beta 0.04
  c.rewards.components = [dict(name="correct", verifier="by_source", weight=1.0)]
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.schedule = "constant"
  c.train.steps = 500
  c.train.prompts_per_step = 64
  c.train.mini_batches = 2
  c.eval.every = 50
  c.eval.num_examples = 256
  c.checkpoint.every = 50
  c.output.dir = "runs/gemma3_1b_gsm8k_grpo"
  return c
