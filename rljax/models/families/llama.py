"""Llama (1, 2, 3.x; SmolLM2 and other `LlamaForCausalLM` checkpoints).

The base decoder with no switch on: full attention, no biases, SwiGLU, untied head by default.
RoPE scaling: Llama 3.1's `llama3` rule, `linear` and `yarn` (rljax/models/rope.py). GGUF: llama.cpp
permutes the q/k rows for its interleaved RoPE (`gguf_permuted_qk`) and stores Llama 3 scaling as
a `rope_freqs` tensor (rljax/models/gguf_io.py).
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.models.families.base import Family


class Llama(Family):
  name = "llama"
  model_types = ("llama",)
  hf_class = "LlamaForCausalLM"
  gguf_architectures = ("llama",)
  gguf_permuted_qk = True

  def from_hf(self, hf: Mapping[str, Any], source: str):
    self.refuse_true(hf, source, "attention_bias", "Llama's attention_bias puts a bias on q, k, v and o_proj, which "
                     "rljax's Llama does not have.")
    self.refuse_true(hf, source, "mlp_bias", "rljax's MLP has no biases.")
    return self.decoder_from_hf(hf, source)

  def to_hf(self, c, dtype: str) -> dict[str, Any]:
    return {**self.decoder_to_hf(c, dtype), "mlp_bias": False}


FAMILIES = (Llama(),)
