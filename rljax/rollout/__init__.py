"""Everything that generates: the typed `Rollout`, the decode core, and the producers.

Modules:
  types      `Rollout` (the batch a step trains on), `RolloutInfo` (what a producer reports beside
             it), the `Producer` protocol: `producer(params, key, prompts) -> (Rollout, RolloutInfo)`
  draw       `SamplingParams` and the token draw (`sample_logits`: temperature, top-k/p, min-p)
  decode     the decode state, the one token choice every loop makes, the model over typed caches
  sampler    the single-turn sampler (`sample`) and its producer
  slots      continuous batching in the sampler: decode slots refilled inside the loop
  generation `rljax.generate`: the sampler for a `Policy`, prompts checked and padded on the host
  segments   decoding in pieces: pause rows, feed them tokens, resume them from their caches
  tools      multi-turn tool use over segments, and its producer
  partial    partial rollouts: a pool of groups carried over calls, over segments

The typed KV caches the decode core carries live with the model (rljax/models/cache.py).
"""
from rljax.rollout.draw import SamplingParams, effective_temperature, sample_logits
from rljax.rollout.generation import default_stop_ids, generate
from rljax.rollout.sampler import SampleOutput, SamplerProducer, check_lengths, sample, stage_ends
from rljax.rollout.types import Producer, Prompts, PromptSource, Rollout, RolloutInfo

__all__ = [
    "Producer", "PromptSource", "Prompts", "Rollout", "RolloutInfo", "SampleOutput", "SamplerProducer",
    "SamplingParams", "check_lengths", "default_stop_ids", "effective_temperature", "generate", "sample",
    "sample_logits", "stage_ends",
]
