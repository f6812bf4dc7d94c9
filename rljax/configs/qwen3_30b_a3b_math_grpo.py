"""Qwen3-30B-A3B (a mixture of experts: 128 experts, 8 per token, 3.35B of 30.5B parameters active)
on competition maths with GRPO, bf16, routing replay on (README "Mixture-of-Experts (Qwen3-MoE)").

  rljax train --config configs/qwen3_30b_a3b_math_grpo.py \
      --config.model.path=/path/to/Qwen3-30B-A3B \
      --config.data.sources='[{"kind": "math", "path": {"train": "/path/to/MATH/train.jsonl",
                                                        "test": "/path/to/MATH/test.jsonl"}}]'

Plan it first (no weights needed, only config.json; scripts/model_configs/qwen3-30b-a3b has it):

  JAX_PLATFORMS=cpu rljax plan --config configs/qwen3_30b_a3b_math_grpo.py \
      --config.model.path=scripts/model_configs/qwen3-30b-a3b --topology v5p:2x2x2 --layers 1,2

Each step samples 8 prompts x 8 completions of up to 3,584 tokens after prompts of up to 512
(4k tokens per row); the update is one optimizer step over the 64 rows in 8 micro-batches of 8
rows. No KL term (no reference copy of the 30B model), the load-balancing loss off (as verl
trains MoE policies with RL), routing replay on: the learner computes each token with the experts
the sampler chose, so a bf16 rounding that flips a top-8 choice does not move the importance ratio.
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "/path/to/Qwen3-30B-A3B"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.attention = "chunked"
  c.model.moe.routing_replay = True     # "auto" would pick it too in bf16; stated for the reader
  c.model.moe.aux_loss_coef = 0.0       # the checkpoint's 0.001 applies only with output_router_logits
  c.data.sources = [dict(kind="math", weight=1.0, verifier="math",
                         path=dict(train="/path/to/MATH/train.jsonl", test="/path/to/MATH/test.jsonl"))]
  c.data.prompt_template = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
  c.data.max_prompt_tokens = 512
  c.sampling.num_samples = 8
  c.sampling.max_new_tokens = 3584
  c.rl.preset = "grpo"
  c.rl.kl_coef = 0.0
  c.rewards.components = [dict(name="correct", verifier="by_source", weight=1.0)]
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.1
  c.train.steps = 500
  c.train.prompts_per_step = 8
  c.train.micro_batches = 8
  c.mesh.shape = (1, -1, 1)             # fsdp over every chip
  c.eval.every = 50
  c.eval.samples = 4
  c.checkpoint.every = 50
  c.output.dir = "runs/qwen3_30b_a3b_math_grpo"
  return c
