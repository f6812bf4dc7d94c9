"""On-policy distillation on the default run's arithmetic problems: the untrained SmolLM2-135M-Instruct
samples, the default GRPO run's export (runs/default/hf, train it first) scores every sampled token, and
the student minimises the per-token reverse KL to it (README "Beyond RL").

Same prompts, group size, steps and learning rate as the default RL run, so the two compare at equal
samples. Greedy held-out accuracy is evaluated before and after, as in the default run.

  rljax train                                            # the default RL run -> runs/default/hf
  rljax train --config configs/distill_arithmetic.py     # distil it into the base model
  rljax train --config configs/rl_after_sft.py --config.model.path=runs/distill_arithmetic/hf \\
      --config.output.dir=runs/rl_after_distill          # then RL from the distilled student
"""
from rljax.configs import default


def get_config():
  c = default.get_config()
  c.train.objective = "distill"
  c.distill.teacher = "runs/default/hf"
  c.distill.reward_weight = 0.0          # pure distillation; > 0 adds the verifier's group advantage per token
  c.output.dir = "runs/distill_arithmetic"
  return c
