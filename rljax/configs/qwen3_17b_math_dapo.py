"""Qwen3-1.7B on competition maths with DAPO: clip-higher, token-mean loss, dynamic sampling,
overlong filtering and the soft overlong punishment, no KL.

  rljax train --config configs/qwen3_17b_math_dapo.py \
      --config.model.path=/path/to/Qwen3-1.7B \
      --config.data.sources='[{"kind": "math", "path": {"train": "/path/to/MATH/train.jsonl",
                                                        "test": "/path/to/MATH/test.jsonl"}}]'

Training reads the "train" file, the held-out evaluation (eval.every, which also picks the best
checkpoint) the "test" file; a single path for both is refused (docs/data.md).
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "/path/to/Qwen3-1.7B"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.data.sources = [dict(kind="math", weight=1.0, verifier="math",
                         path=dict(train="/path/to/MATH/train.jsonl", test="/path/to/MATH/test.jsonl"))]
  c.data.prompt_template = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
  c.data.max_prompt_tokens = 512
  c.sampling.num_samples = 16
  c.sampling.max_new_tokens = 2048
  c.rl.preset = "dapo"                  # clip 0.2/0.28, token-mean, overlong filter, no KL
  c.rewards.components = [
      dict(name="correct", verifier="by_source", weight=1.0),
      dict(name="overlong", verifier="overlong", weight=1.0, kwargs=dict(max_len=2048, buffer=512)),
  ]
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 20
  c.optim.weight_decay = 0.1
  c.train.steps = 1000
  c.train.prompts_per_step = 32
  c.train.mini_batches = 4
  c.train.dynamic_sampling = True
  c.train.oversample = 3
  c.eval.every = 50
  c.eval.samples = 4
  c.eval.temperature = 1.0
  c.checkpoint.every = 50
  c.output.dir = "runs/qwen3_17b_math_dapo"
  return c
