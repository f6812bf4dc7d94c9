"""Qwen3 dense models (`Qwen3ForCausalLM`): RMSNorm on each head's q and k before RoPE, no biases,
`head_dim` independent of hidden / heads, YaRN for contexts beyond 32k (rope_scaling in config.json).

Refused by name: `attention_bias` (a bias on q, k, v and o_proj), the sliding window, and the
mixture-of-experts fields of a Qwen3-MoE config mislabelled `qwen3` (Family.refuse_common).
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.models.families.base import Family
from rljax.models.families.qwen2 import refuse_sliding_window


class Qwen3(Family):
  name = "qwen3"
  model_types = ("qwen3",)
  hf_class = "Qwen3ForCausalLM"
  gguf_architectures = ("qwen3",)
  fixed = {**Family.fixed, "qk_norm": True}

  def from_hf(self, hf: Mapping[str, Any], source: str):
    self.refuse_true(hf, source, "attention_bias", "Qwen3's attention_bias puts a bias on q, k, v and o_proj, "
                     "which rljax's Qwen3 does not have.")
    refuse_sliding_window(self, hf, source)
    return self.decoder_from_hf(hf, source)

  def to_hf(self, c, dtype: str) -> dict[str, Any]:
    out = self.decoder_to_hf(c, dtype)
    return {**out, "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_layers}


FAMILIES = (Qwen3(),)
