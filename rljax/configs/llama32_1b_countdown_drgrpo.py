"""Llama-3.2-1B-Instruct on countdown with Dr. GRPO (no std scaling, token sums over a constant).

  rljax train --config configs/llama32_1b_countdown_drgrpo.py \
      --config.model.path=/path/to/Llama-3.2-1B-Instruct

The countdown task is generated in-process (difficulty = how many numbers).
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "/path/to/Llama-3.2-1B-Instruct"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.data.sources = [dict(kind="countdown", weight=1.0, verifier="countdown", difficulty=2, seed=0)]
  c.data.prompt_template = ("{prompt}\nShow your work in <think> </think> tags and give the final expression "
                            "in <answer> </answer> tags.")
  c.data.max_prompt_tokens = 256
  c.sampling.num_samples = 8
  c.sampling.max_new_tokens = 1024
  c.rl.preset = "dr_grpo"
  c.rl.agg_norm = 1024.0                # Dr. GRPO's constant: max_new_tokens
  c.rewards.components = [
      dict(name="correct", verifier="by_source", weight=1.0),
      dict(name="format", verifier="format", weight=0.1),
  ]
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.train.steps = 500
  c.train.prompts_per_step = 32
  c.eval.every = 50
  c.checkpoint.every = 50
  c.output.dir = "runs/llama32_1b_countdown_drgrpo"
  return c
