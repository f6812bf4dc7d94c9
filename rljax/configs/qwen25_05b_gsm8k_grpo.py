"""Qwen2.5-0.5B-Instruct on GSM8K with GRPO (DeepSeekMath settings, KL 0.04 to the initial policy).

  rljax train --config configs/qwen25_05b_gsm8k_grpo.py \
      --config.model.path=/path/to/Qwen2.5-0.5B-Instruct \
      --config.data.sources='[{"kind": "gsm8k", "path": {"train": "/path/to/gsm8k/train.jsonl",
                                                         "test": "/path/to/gsm8k/test.jsonl"}}]'

The source names one file per split: training reads "train", the held-out evaluation (every
eval.every steps and before/after, which also picks the best checkpoint) reads "test". One path
for both would score the model on its training prompts, so the config is refused unless
eval.allow_training_data=True. Sized for one accelerator host (8 chips, data parallel); change
mesh.shape for pods.
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "/path/to/Qwen2.5-0.5B-Instruct"
  c.model.dtype = "bfloat16"
  c.model.remat = True
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
  c.output.dir = "runs/qwen25_05b_gsm8k_grpo"
  return c
