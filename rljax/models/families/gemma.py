"""Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`, model_type `gemma3_text`).

Their switches: (1 + w) RMSNorms, sandwich norms (HF's post_attention_layernorm /
post_feedforward_layernorm on each branch's output; pre_feedforward_layernorm before the MLP),
embeddings scaled by sqrt(D), GeGLU, attention scaled by `query_pre_attn_scalar`, sliding-window
layers (Gemma 2: every other layer; Gemma 3: 5 of every 6, with their own RoPE base) and, for
Gemma 2, soft-capped attention scores and logits. Gemma 3 adds q/k norms. Prompts must start with
<bos> (`bos_first`). Gemma 3's linear RoPE scaling (the 4B+ models) applies to its global layers.
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.errors import WeightsError
from rljax.models.families.base import Family
from rljax.models.rope import rope_dict, scaling_from_hf

_GEMMA_FIXED = dict(attention_bias=False, norm_offset=True, sandwich_norms=True, embed_scale=True)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else float(x)


class Gemma2(Family):
  name = "gemma2"
  model_types = ("gemma2",)
  hf_class = "Gemma2ForCausalLM"
  bos_first = True
  fixed = {**_GEMMA_FIXED, "qk_norm": False}
  default_context = 8192
  default_tied = True
  default_head_dim = 256
  default_act = "gelu_pytorch_tanh"
  gemma_fields = ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "sliding_window")
  norm_names = {"input_norm": "input_layernorm.weight", "post_attn_norm": "pre_feedforward_layernorm.weight",
                "attn_out_norm": "post_attention_layernorm.weight",
                "mlp_out_norm": "post_feedforward_layernorm.weight"}
  gguf_layer_names = {}
  sliding_period = 2   # transformers' default layer pattern: layer i slides unless (i + 1) % period == 0

  def random_defaults(self, num_layers: int, head_dim: int) -> dict[str, Any]:
    return dict(self.fixed, hidden_act="gelu_tanh", attn_logit_softcap=50.0, final_logit_softcap=30.0,
                query_pre_attn_scalar=float(head_dim), sliding_window=4096,
                sliding_layers=tuple(bool((i + 1) % self.sliding_period) for i in range(num_layers)))

  def rope(self, hf: Mapping[str, Any], source: str, context: int) -> dict[str, Any]:
    """rope_theta / rope_scaling / rope_local_theta from the 4.x or 5.x rope fields."""
    rope = rope_dict(hf)
    if scaling_from_hf(rope, context, source) is not None:
      raise WeightsError(f"{source}: rope_type={rope.get('rope_type', rope.get('type'))!r} is not supported for "
                         "gemma2; rljax implements default RoPE for Gemma 2 (no Gemma 2 checkpoint scales it).")
    return dict(rope_theta=float(rope.get("rope_theta") or self.default_theta))

  def from_hf(self, hf: Mapping[str, Any], source: str):
    self.refuse_true(hf, source, "attention_bias", f"{self.name}'s attention_bias puts a bias on q, k, v and o_proj, "
                     "which rljax's Gemma does not have.")
    self.refuse_true(hf, source, "use_bidirectional_attention", "rljax decodes causally.")
    layers = int(hf.get("num_hidden_layers") or 0)
    layer_types = hf.get("layer_types")
    if layer_types is None:
      pattern = int(hf.get("sliding_window_pattern") or self.sliding_period)
      layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(layer_types) != layers or not set(layer_types) <= set(_LAYER_TYPES):
      raise WeightsError(f"{source}: layer_types={layer_types!r} must list 'sliding_attention' or "
                         f"'full_attention' for each of the {layers} layers.")
    window = hf.get("sliding_window")
    opt = lambda name: None if hf.get(name) is None else float(hf[name])
    context = int(hf.get("max_position_embeddings") or self.default_context)
    return self.decoder_from_hf(
        hf, source, **self.rope(hf, source, context),
        attn_logit_softcap=opt("attn_logit_softcapping"), final_logit_softcap=opt("final_logit_softcapping"),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=None if window is None else int(window),
        sliding_layers=() if window is None else tuple(t == "sliding_attention" for t in layer_types))

  def check_exportable(self, c) -> None:
    super().check_exportable(c)
    if c.hidden_act != "gelu_tanh":
      raise WeightsError(f"model.architecture={c.architecture!r} with hidden_act={c.hidden_act!r} is not a "
                         f"transformers {self.name} model, which uses hidden_act='gelu_tanh' (GeGLU).")

  def to_hf(self, c, dtype: str) -> dict[str, Any]:
    out = self.decoder_to_hf(c, dtype)
    del out["hidden_act"]
    sliding = c.sliding_layers or (False,) * c.num_layers
    out.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None
                                               else c.head_dim),   # transformers types it int
        "sliding_window": c.sliding_window,
        "layer_types": [_LAYER_TYPES[0] if s else _LAYER_TYPES[1] for s in sliding],
        "attn_logit_softcapping": c.attn_logit_softcap,
        "final_logit_softcapping": c.final_logit_softcap,
    })
    out.update(self.rope_to_hf(c))
    return out

  def rope_to_hf(self, c) -> dict[str, Any]:
    if c.rope_scaling is not None:
      raise WeightsError(f"model.rope_scaling ({c.rope_scaling.rope_type}) has no Gemma 2 equivalent in "
                         "transformers; set it to None.")
    if c.rope_local_theta not in (None, c.rope_theta):
      raise WeightsError("model.rope_local_theta differs from model.rope_theta, which Gemma 2 cannot express; "
                         "set model.rope_local_theta=None.")
    return {"rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "rope_scaling": None}


class Gemma3(Gemma2):
  """Gemma 3 text: Gemma 2 without soft-caps by default, with q/k norms, a local RoPE base for the
  sliding layers (5.x: rope_parameters per layer type; 4.x: rope_local_base_freq) and optional
  linear RoPE scaling of the global layers."""
  name = "gemma3"
  model_types = ("gemma3_text",)
  hf_class = "Gemma3ForCausalLM"
  fixed = {**_GEMMA_FIXED, "qk_norm": True}
  refused_model_types = {"gemma3": "is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); rljax supports "
                                   "the text-only Gemma3ForCausalLM (model_type 'gemma3_text', e.g. google/gemma-3-1b-it)."}
  default_theta = 1_000_000.0
  default_local_theta = 10_000.0
  gemma_fields = Gemma2.gemma_fields + ("rope_local_theta",)
  sliding_period = 6

  def random_defaults(self, num_layers: int, head_dim: int) -> dict[str, Any]:
    out = super().random_defaults(num_layers, head_dim)
    return dict(out, attn_logit_softcap=None, final_logit_softcap=None, rope_theta=self.default_theta,
                rope_local_theta=self.default_local_theta)

  def rope(self, hf: Mapping[str, Any], source: str, context: int) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or {})
    full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    if not full and not local and rope:   # a flat 5.x dict: the global layers'
      full = rope
    legacy = hf.get("rope_scaling") or {}
    if legacy and not full.get("rope_type"):
      full.update(legacy)
    if scaling_from_hf(local, context, source, "rope_parameters.sliding_attention") is not None:
      raise WeightsError(f"{source}: rope_parameters.sliding_attention.rope_type="
                         f"{local.get('rope_type', local.get('type'))!r} is not supported; rljax scales the RoPE "
                         "of Gemma 3's global layers only (the sliding layers' is default).")
    return dict(rope_theta=float(full.get("rope_theta") or hf.get("rope_theta") or self.default_theta),
                rope_scaling=scaling_from_hf(full, context, source, "rope_parameters.full_attention"),
                rope_local_theta=float(local.get("rope_theta") or hf.get("rope_local_base_freq")
                                       or self.default_local_theta))

  def rope_to_hf(self, c) -> dict[str, Any]:
    local = c.rope_theta if c.rope_local_theta is None else c.rope_local_theta
    full = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
      full = {**c.rope_scaling.to_hf(), "rope_theta": c.rope_theta}
    return {"rope_theta": c.rope_theta, "rope_local_base_freq": local,
            "rope_scaling": None if c.rope_scaling is None else {k: v for k, v in full.items() if k != "rope_theta"},
            "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": local}}}


FAMILIES = (Gemma2(), Gemma3())
