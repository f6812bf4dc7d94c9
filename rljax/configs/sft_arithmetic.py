"""Supervised fine-tuning of SmolLM2-135M-Instruct on the default run's arithmetic problems, the
worked reference answers as targets: the cold start before RL (README "Beyond RL").

The prompts are rendered exactly as the default RL recipe renders them (same source, prompt template
and chat template), and each target is the assistant turn "<expression> = <answer><|im_end|>" (e.g.
"7 * 8 = 56"), so the model learns the format and the answers the RL run is rewarded for, with the
working the base model already writes when it gets a sum right. Bare answers as targets
(--config.sft.response_template='{answer}') train that working away and gain nothing on this task
(README "Beyond RL"). Greedy held-out accuracy is evaluated before and after, as in the default run.

  rljax train --config configs/sft_arithmetic.py
  rljax train --config configs/rl_after_sft.py     # then RL from its export (runs/sft_arithmetic/hf)
"""
from rljax.configs import default


def get_config():
  c = default.get_config()
  c.train.objective = "sft"
  # Procedural sources have no response field: the target is made from the row's fields.
  c.sft.response_template = "{expression} = {answer}"
  c.sampling.num_samples = 1             # not read by sft (one target per prompt); evaluation uses eval.*
  c.train.steps = 24
  c.train.prompts_per_step = 8
  c.optim.learning_rate = 1e-5
  c.optim.warmup_steps = 2
  c.output.dir = "runs/sft_arithmetic"
  return c
