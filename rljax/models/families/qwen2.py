"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): q/k/v projections with biases (always, in transformers'
Qwen2), tied embeddings in the small models, RoPE base 1e6, YaRN for contexts beyond 32k.

Sliding-window attention (`use_sliding_window`) is refused: no released Qwen2 / Qwen2.5 checkpoint
turns it on, and rljax's Qwen2 attends to the full context in every layer.
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.errors import WeightsError
from rljax.models.families.base import Family


def refuse_sliding_window(family: Family, hf: Mapping[str, Any], source: str) -> None:
  """Qwen's sliding window (`use_sliding_window` with layers at or past `max_window_layers`, or
  5.x `layer_types`) changes the attention; refused by name when a layer would use it."""
  if not (hf.get("use_sliding_window") and hf.get("sliding_window")):
    return
  layers = int(hf.get("num_hidden_layers") or 0)
  types = hf.get("layer_types") or ["sliding_attention" if i >= int(hf.get("max_window_layers") or 0)
                                    else "full_attention" for i in range(layers)]
  if "sliding_attention" in types:
    raise WeightsError(f"{source}: use_sliding_window=true (sliding_window={hf['sliding_window']}, "
                       f"max_window_layers={hf.get('max_window_layers')}) is not supported for {family.name}; rljax "
                       "uses full attention in every layer.")


class Qwen2(Family):
  name = "qwen2"
  model_types = ("qwen2",)
  hf_class = "Qwen2ForCausalLM"
  gguf_architectures = ("qwen2",)
  fixed = {**Family.fixed, "attention_bias": True}

  def from_hf(self, hf: Mapping[str, Any], source: str):
    refuse_sliding_window(self, hf, source)
    return self.decoder_from_hf(hf, source)

  def to_hf(self, c, dtype: str) -> dict[str, Any]:
    return {**self.decoder_to_hf(c, dtype), "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_layers}


FAMILIES = (Qwen2(),)
