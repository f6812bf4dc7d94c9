"""A tiny random model that a test can train in seconds: the reward rises within a few steps.

The task: write digits. A random model puts little mass on digit tokens; the `digits`
reward (fraction of characters that are digits) gives every group a spread to learn from.
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "random"
  c.tokenizer = "smollm2-135m-instruct"
  c.model.random.update(dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, seed=0))
  c.data.sources = [dict(kind="arithmetic", weight=1.0, verifier="arithmetic", difficulty=1, seed=0)]
  c.data.chat_template = False
  c.data.max_prompt_tokens = 16
  c.sampling.num_samples = 4
  c.sampling.max_new_tokens = 8
  c.rl.preset = "grpo"
  c.rl.kl_coef = 0.0
  c.rewards.components = [dict(name="digits", verifier="rljax.configs.smoke:digit_fraction", weight=1.0)]
  c.rewards.num_workers = 1
  c.optim.learning_rate = 3e-3
  c.train.steps = 8
  c.train.prompts_per_step = 8
  c.eval.before_and_after = False
  c.output.dir = "runs/smoke"
  c.output.export_hf = False
  c.output.progress = False
  return c


def digit_fraction(completion: str, example) -> float:
  """Fraction of non-space characters that are digits (0 for an empty completion)."""
  chars = [ch for ch in completion if not ch.isspace()]
  return sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0
