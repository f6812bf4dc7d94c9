"""A tiny random model that a test can train in seconds: the reward rises within a few steps.

The task: write vowels. The `vowels` reward (fraction of letters that are vowels) is dense:
random tokens already score about 0.3 with a spread inside every group, so GRPO has signal
from the first step and a tiny random model learns it in a few steps.

  rljax train --config configs/smoke.py        # 20 steps, about 30 s on 2 CPU cores; progress bar on stderr

The reward is continuous, so reward/mean (not reward/accuracy, the share of completions with a
positive score) is the figure to watch.
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "random"
  c.tokenizer = "smollm2-135m-instruct"
  c.model.random.update(dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, seed=0))
  # The arithmetic problems are only text to continue: no verifier checks their answers (verifier
  # "none"); the reward is the `vowels` component, which scores every row.
  c.data.sources = [dict(kind="arithmetic", weight=1.0, verifier="none", difficulty=1, seed=0)]
  c.data.chat_template = False
  c.data.max_prompt_tokens = 16
  c.sampling.num_samples = 8
  c.sampling.max_new_tokens = 8
  c.rl.preset = "grpo"
  c.rl.kl_coef = 0.0
  c.rewards.components = [dict(name="vowels", verifier="rljax.configs.smoke:vowel_fraction", weight=1.0)]
  c.rewards.num_workers = 1
  # The vowel count takes microseconds; the default 5 s per call could still trip on a loaded
  # machine (a fresh worker waiting for a core), and a timed-out row scores the fallback 0.
  c.rewards.timeout_s = 60.0
  c.optim.learning_rate = 1e-1          # a tiny random model needs a large step
  c.train.steps = 20
  c.train.prompts_per_step = 8
  c.eval.before_and_after = False
  c.output.dir = "runs/smoke"
  c.output.export_hf = False
  return c


def vowel_fraction(completion: str, example) -> float:
  """Fraction of letters that are vowels (0 when there are no letters)."""
  letters = [ch for ch in completion.lower() if ch.isalpha()]
  return sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0

