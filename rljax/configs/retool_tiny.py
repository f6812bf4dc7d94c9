"""ReTool-style maths with a code interpreter, at a size this CPU runs in minutes.

SmolLM2-135M-Instruct solves arithmetic; mid-answer it may write a ```python block, which runs in
the sandboxed interpreter (state kept across the trajectory's blocks) and comes back in an
<interpreter> block, after which the model continues. Rewards score the final trajectory;
interpreter output is context, never trained on (docs/tools.md).

  rljax train --config configs/retool_tiny.py
  rljax train --config configs/retool_tiny.py --config.model.path=/path/to/Qwen2.5-Math-1.5B-Instruct \\
      --config.train.steps=400 --config.sampling.max_new_tokens=1024 --config.tools.max_turns=8 \\
      --config.data.sources='[{"kind": "arithmetic", "verifier": "arithmetic", "difficulty": 3}]'
"""
from rljax.config import base_config

SYSTEM_PROMPT = ("You are a careful maths assistant with a Python interpreter. To compute, write a "
                 "```python code block that prints the result; its output is returned to you in an "
                 "<interpreter> block. Then give the final answer as: The answer is <number>.")


def get_config():
  c = base_config()
  # One-digit problems: the 135M model solves some of them, so the run shows a reward above 0 (at
  # difficulty 3 it scored 0.000 in both steps); a larger model takes harder ones (see the docstring).
  c.data.sources = [dict(kind="arithmetic", weight=1.0, verifier="arithmetic", difficulty=1, seed=0)]
  c.data.system_prompt = SYSTEM_PROMPT
  c.data.max_prompt_tokens = 128
  c.sampling.num_samples = 4
  c.sampling.max_new_tokens = 192
  c.sampling.temperature = 1.0
  c.tools.enabled = True
  c.rollout.mode = "pipelined"       # multi-turn generation is the pipelined mode's producer
  c.rollout.max_staleness = 0        # on-policy: generate the next batch only after this update
  c.tools.names = ["python"]
  c.tools.format = "python"
  c.tools.max_turns = 2
  c.tools.segment_tokens = 32
  c.tools.max_response_tokens = 64
  c.tools.timeout_s = 5.0
  c.rl.preset = "grpo"
  c.rl.kl_coef = 0.0
  c.rewards.components = [dict(name="correct", verifier="by_source", weight=1.0)]
  c.optim.learning_rate = 1e-6
  c.train.steps = 2
  c.train.prompts_per_step = 4
  c.eval.before_and_after = False
  c.output.dir = "runs/retool_tiny"
  c.output.export_hf = False
  return c
