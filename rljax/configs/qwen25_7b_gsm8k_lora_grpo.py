"""Qwen2.5-7B-Instruct on GSM8K with GRPO and LoRA: a model that full fine-tuning does not fit on a v5e-8.

  rljax train --config configs/qwen25_7b_gsm8k_lora_grpo.py \
      --config.model.path=/path/to/Qwen2.5-7B-Instruct \
      --config.data.sources='[{"kind": "gsm8k", "path": {"train": "/path/to/gsm8k/train.jsonl",
                                                         "test": "/path/to/gsm8k/test.jsonl"}}]'

Rank-32 adapters on every attention and MLP projection; the base stays frozen in bf16 (2 bytes a
parameter, no fp32 master, no AdamW moments: those exist for the adapters only) and is also the
KL reference, so the reference costs no second copy. LoRA takes a learning rate about 10x full
fine-tuning's (1e-6 in the 0.5B recipe). Check the fit first:

  rljax plan --config configs/qwen25_7b_gsm8k_lora_grpo.py \
      --config.model.path=scripts/model_configs/qwen2.5-7b --topology v5e-8

The run ends with `<output.dir>/hf` (adapters merged: a plain HF model) and `<output.dir>/peft`
(the adapters alone, for `peft.PeftModel.from_pretrained`).
"""
from rljax.config import base_config


def get_config():
  c = base_config()
  c.model.path = "/path/to/Qwen2.5-7B-Instruct"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.lora.update(dict(rank=32, alpha=64.0, dropout=0.0,
                           targets=["q", "k", "v", "o", "gate", "up", "down"]))
  c.mesh.shape = (1, -1, 1)             # fsdp over the host's chips: the bf16 base is split 8 ways
  c.data.sources = [dict(kind="gsm8k", weight=1.0, verifier="gsm8k",
                         path=dict(train="/path/to/gsm8k/train.jsonl", test="/path/to/gsm8k/test.jsonl"))]
  c.data.system_prompt = "Please reason step by step, and put your final answer after '####'."
  c.data.max_prompt_tokens = 256
  c.sampling.num_samples = 8
  c.sampling.max_new_tokens = 512
  c.rl.preset = "grpo"                  # group mean/std, clip 0.2, k3 KL beta 0.04 to the base (adapters off)
  c.rewards.components = [dict(name="correct", verifier="by_source", weight=1.0)]
  c.optim.learning_rate = 1e-5
  c.optim.warmup_steps = 10
  c.train.steps = 300
  c.train.prompts_per_step = 32
  c.train.mini_batches = 2
  c.eval.every = 50
  c.eval.num_examples = 256
  c.checkpoint.every = 25               # adapters + their optimizer state only: megabytes, not gigabytes
  c.output.dir = "runs/qwen25_7b_gsm8k_lora_grpo"
  return c
