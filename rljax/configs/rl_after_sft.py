"""The second stage of a two-stage run: the default GRPO recipe starting from the SFT run's export
(configs/sft_arithmetic.py writes runs/sft_arithmetic/hf). README "Beyond RL".

  rljax train --config configs/sft_arithmetic.py
  rljax train --config configs/rl_after_sft.py
"""
from rljax.configs import default


def get_config():
  c = default.get_config()
  c.model.path = "runs/sft_arithmetic/hf"   # any stage's export: an HF directory rljax and transformers load
  c.output.dir = "runs/rl_after_sft"
  return c
