"""Prompt data for RLVR: sources, procedural tasks, mixtures, batching.

  ds = build_dataset(cfg, split="train", process_index=jax.process_index(),
                     process_count=jax.process_count())
  batcher = PromptBatcher(ds, tokenizer, prompts_per_batch=P)
  for batch in batcher: ...          # PromptBatch(prompt_ids, prompt_mask, examples)
  saved = batcher.state(); batcher.restore(saved)

See docs/data.md for the config fields.
"""
from rljax.data.batching import PromptBatch, PromptBatcher, render_prompt
from rljax.data.config import SOURCE_KINDS, default_config, normalize_config
from rljax.data.formats import Example, extract_boxed, extract_gsm8k_answer
from rljax.data.pipeline import Malformed, PromptDataset, build_dataset
from rljax.data.procedural import ArithmeticTask, CountdownTask, is_held_out

__all__ = [
    "ArithmeticTask", "CountdownTask", "Example", "Malformed", "PromptBatch", "PromptBatcher", "PromptDataset",
    "SOURCE_KINDS", "build_dataset", "default_config", "extract_boxed", "extract_gsm8k_answer", "is_held_out",
    "normalize_config", "render_prompt",
]
