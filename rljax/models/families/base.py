"""`Family`: everything rljax knows about one model family, in one place.

A family module (rljax/models/families/<name>.py) defines a `Family` subclass and lists its
instances in `FAMILIES`; the registry (families/__init__.py) finds it by itself. The base class
describes the decoder every family runs today (rljax/models/transformer.py: attention with
optional q/k/v biases and q/k norms, a gated MLP, RMSNorms, optional Gemma switches), so a dense
family states only how it differs: its names, its fixed switches, its HF config fields, the
fields it refuses. A family with another block (a mixture of experts, rljax/models/families/
qwen3_moe.py) says which layers have which kind of feed-forward block (`layer_kinds`), gives the
block of each kind (`block`) and its tensors (`block_tensors`), and overrides `num_params`, the
FLOP counts and `lora_targets`.

Layers of one kind share a stacked parameter tree; when a model's layers are of several kinds,
each kind has its own stack (`stack_names`) and the decoder runs them in model order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rljax.errors import WeightsError
from rljax.models import layouts
from rljax.models.config import LORA_TARGETS, ModelConfig
from rljax.models.layers import MLP
from rljax.models.rope import rope_dict, scaling_from_hf

# HF activation names -> ModelConfig.hidden_act. Exact-erf GELU ("gelu") and others are refused.
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
_HF_ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
# Fields of a mixture-of-experts config: on a dense model type they mean the checkpoint is not dense.
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "moe_intermediate_size",
              "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size")
# The architecture switches of ModelConfig: every family fixes each one (`Family.fixed`).
SWITCHES = ("attention_bias", "qk_norm", "norm_offset", "sandwich_norms", "embed_scale")
# Gemma's extra hyper-parameters: a family that cannot express them in HF needs them off.
GEMMA_FIELDS = ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "sliding_window",
                "rope_local_theta")


class Family:
  """One model family: names, HF config in and out, weight names and layouts, costs, LoRA targets.

  Class attributes:
    name: ModelConfig.architecture; model_types: HF `model_type` values it reads (the first is
    written); hf_class: the `architectures` entry written; gguf_architectures: llama.cpp
    `general.architecture` values it reads (() = no GGUF); gguf_permuted_qk: llama.cpp stored q/k
    rows permuted for interleaved RoPE (Llama); bos_first: prompts must start with <bos>
    (data/batching.py's check); fixed: the value of every switch in SWITCHES; lora_targets: the
    projections an adapter can sit on; refused_model_types: model_type -> why it is not this family.
    Defaults of HF fields when config.json omits them: default_theta, default_context,
    default_tied, default_head_dim (None: hidden / heads), default_act.
  """
  name: str = ""
  model_types: tuple[str, ...] = ()
  hf_class: str = ""
  gguf_architectures: tuple[str, ...] = ()
  gguf_permuted_qk: bool = False
  bos_first: bool = False
  fixed: Mapping[str, Any] = dict(attention_bias=False, qk_norm=False, norm_offset=False, sandwich_norms=False,
                                  embed_scale=False)
  lora_targets: tuple[str, ...] = LORA_TARGETS
  lora_note: str = ""          # appended to the error naming lora_targets (why the others take none)
  mixture_of_experts: bool = False   # its models carry a ModelConfig.moe
  main_kind: str = "dense"     # the layer kind whose stack is called "layers"
  refused_model_types: Mapping[str, str] = {}
  default_theta: float = 10000.0
  default_context: int = 2048
  default_tied: bool = False
  default_head_dim: int | None = None
  default_act: str = "silu"
  gemma_fields: tuple[str, ...] = ()   # of GEMMA_FIELDS, the ones this family's HF config can express
  # HF names of the norms (per-layer suffixes); "attn_out_norm" / "mlp_out_norm" only with sandwich norms.
  norm_names: Mapping[str, str] = {"input_norm": "input_layernorm.weight",
                                   "post_attn_norm": "post_attention_layernorm.weight"}
  # llama.cpp per-layer tensor names -> HF suffixes (families with GGUF support).
  gguf_layer_names: Mapping[str, str] = {
      "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
      "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
      "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
      "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
      "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
      "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
      "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}

  def __repr__(self) -> str:
    return f"<rljax model family {self.name!r}>"

  # ---- the model ------------------------------------------------------------------------------

  def feed_forward(self, config: ModelConfig):
    """The dense feed-forward block's module class (rljax/models/layers.py documents the protocol)."""
    return MLP

  def layer_kinds(self, config: ModelConfig) -> tuple[str, ...]:
    """The kind of each layer's feed-forward block, in model order ("dense" for every layer here)."""
    return ("dense",) * config.num_layers

  def block(self, config: ModelConfig, kind: str):
    """(name in the layer's tree, module class) of the feed-forward block of layers of `kind`."""
    if kind != "dense":
      raise ValueError(f"{self.name} has no {kind!r} layers")
    return "mlp", self.feed_forward(config)

  def stack_names(self, config: ModelConfig) -> dict[str, str]:
    """Layer kind -> the key of its stacked parameters: "layers" for a model of one kind (and for
    `main_kind`), "<kind>_layers" for the others."""
    kinds = sorted(set(self.layer_kinds(config)), key=lambda k: (k != self.main_kind, k))
    return {k: "layers" if i == 0 else f"{k}_layers" for i, k in enumerate(kinds)}

  def random_defaults(self, num_layers: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig fields of a random model of this family beyond its shape (`model.path="random"`):
    the fixed switches, plus transformers' defaults of the family's other hyper-parameters."""
    return dict(self.fixed)

  # ---- HF config.json in --------------------------------------------------------------------

  def from_hf(self, hf: Mapping[str, Any], source: str) -> ModelConfig:
    """A transformers 4.x or 5.x config.json dict of this family -> ModelConfig."""
    return self.decoder_from_hf(hf, source)

  def decoder_from_hf(self, hf: Mapping[str, Any], source: str, **fields) -> ModelConfig:
    """The fields every family reads the same way, then `fields` (the family's own) on top."""
    self.refuse_common(hf, source)
    try:
      heads = int(hf["num_attention_heads"])
      hidden = int(hf["hidden_size"])
      context = int(hf.get("max_position_embeddings") or self.default_context)
      if "rope_theta" not in fields:
        rope = rope_dict(hf)
        fields["rope_theta"] = float(rope.get("rope_theta") or self.default_theta)
        fields["rope_scaling"] = scaling_from_hf(rope, context, source)
      eos = hf.get("eos_token_id")
      out = dict(
          architecture=self.name,
          vocab_size=int(hf["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_layers=int(hf["num_hidden_layers"]),
          num_heads=heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or heads),
          head_dim=int(hf.get("head_dim") or self.default_head_dim or hidden // heads),
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          max_position_embeddings=context,
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", self.default_tied)),
          bos_token_id=hf.get("bos_token_id"),
          eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),)),
          pad_token_id=hf.get("pad_token_id"),
          hidden_act=self.activation(hf, source),
          **self.fixed)
    except KeyError as e:
      raise WeightsError(f"{source}: required field {e.args[0]!r} is missing from the model config.") from None
    out.update(fields)
    return ModelConfig(**out)

  def activation(self, hf: Mapping[str, Any], source: str) -> str:
    field = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    act = hf.get(field) or self.default_act
    if act not in HF_ACTIVATIONS:
      raise WeightsError(f"{source}: {field}={act!r} is not supported for {self.name}; rljax implements "
                         f"{', '.join(sorted(HF_ACTIVATIONS))} (SwiGLU or tanh-approximated GeGLU).")
    return HF_ACTIVATIONS[act]

  def refuse_common(self, hf: Mapping[str, Any], source: str) -> None:
    """Refuses, by name, fields any family's dense decoder cannot compute: mixture-of-experts
    fields, quantized weights, partial rotary embeddings."""
    self.refuse_moe_fields(hf, source)
    if hf.get("quantization_config"):
      method = (hf["quantization_config"] or {}).get("quant_method", "?")
      raise WeightsError(f"{source}: quantization_config (quant_method={method!r}) is not supported; rljax loads "
                         "unquantized safetensors (float32 / bfloat16 / float16) or GGUF files.")
    if float(hf.get("partial_rotary_factor") or 1.0) != 1.0:
      raise WeightsError(f"{source}: partial_rotary_factor={hf['partial_rotary_factor']!r} is not supported; rljax "
                         "rotates the whole head dimension.")

  def refuse_moe_fields(self, hf: Mapping[str, Any], source: str) -> None:
    """A dense family refuses every mixture-of-experts field (a MoE family overrides this)."""
    moe = [f for f in MOE_FIELDS if hf.get(f) not in (None, 0, [], False)]
    if moe:
      raise WeightsError(f"{source}: model_type={hf.get('model_type')!r} carries mixture-of-experts fields "
                         f"({', '.join(f'{f}={hf[f]!r}' for f in moe)}) that rljax's dense {self.name} model would "
                         "ignore; this checkpoint is not a dense model and is not supported.")

  @staticmethod
  def refuse_true(hf: Mapping[str, Any], source: str, field: str, why: str) -> None:
    """Refuses `field` when config.json sets it to a true value."""
    if hf.get(field):
      raise WeightsError(f"{source}: {field}={hf[field]!r} is not supported: {why}")

  # ---- HF config.json out -------------------------------------------------------------------

  def to_hf(self, c: ModelConfig, dtype: str) -> dict[str, Any]:
    """A transformers-loadable config.json dict (4.x and 5.x field names)."""
    return self.decoder_to_hf(c, dtype)

  def check_exportable(self, c: ModelConfig) -> None:
    """Refuses to write a config.json transformers would read as another model."""
    wrong = [f"{k}={getattr(c, k)!r}" for k, v in self.fixed.items() if getattr(c, k) != v]
    if wrong:
      raise WeightsError(f"model.architecture={c.architecture!r} with {', '.join(wrong)} is not a transformers "
                         f"{self.name} model, whose switches are "
                         f"{', '.join(f'{k}={v!r}' for k, v in self.fixed.items())}.")
    extra = [f for f in GEMMA_FIELDS if f not in self.gemma_fields and getattr(c, f) is not None]
    if c.has_sliding_layers and "sliding_window" not in self.gemma_fields:
      extra.append("sliding_layers")
    if extra:
      raise WeightsError(f"model.architecture={c.architecture!r}: transformers' {self.name} has no "
                         f"{', '.join(extra)}; set {'them' if len(extra) > 1 else 'it'} to None.")

  def decoder_to_hf(self, c: ModelConfig, dtype: str) -> dict[str, Any]:
    self.check_exportable(c)
    eos = list(c.eos_token_ids)
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
      rope = {**c.rope_scaling.to_hf(), "rope_theta": c.rope_theta}
    return {
        "architectures": [self.hf_class],
        "model_type": self.model_types[0],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": _HF_ACTIVATION_NAMES[c.hidden_act],
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if c.rope_scaling is None else dict(rope),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": c.pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }

  # ---- weights ------------------------------------------------------------------------------

  def tensors(self, c: ModelConfig) -> list[layouts.Tensor]:
    """Every parameter of the rljax tree with its HF name and layout (rljax/models/layouts.py)."""
    T = layouts.Tensor
    d, v = c.hidden_size, c.vocab_size
    out = [T(("embedding",), "model.embed_tokens.weight", "ident", (v, d), per_layer=False),
           T(("final_norm", "scale"), "model.norm.weight", "ident", (d,), per_layer=False)]
    if not c.tie_word_embeddings:
      out.append(T(("lm_head",), "lm_head.weight", "t", (d, v), per_layer=False))
    kinds = self.layer_kinds(c)
    stacks = self.stack_names(c)
    for kind, stack in stacks.items():
      ids = tuple(i for i, k in enumerate(kinds) if k == kind)
      where = dict(stack=stack, layers=None if len(ids) == c.num_layers else ids)
      out += [dataclasses.replace(t, **where) for t in self.layer_tensors(c) + self.block_tensors(c, kind)]
    return out

  def layer_tensors(self, c: ModelConfig) -> list[layouts.Tensor]:
    """One layer's tensors besides its feed-forward block: norms and attention."""
    T = layouts.Tensor
    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    norms = ("input_norm", "post_attn_norm") + (("attn_out_norm", "mlp_out_norm") if c.sandwich_norms else ())
    out = [T((n, "scale"), self.norm_names[n], "ident", (d,)) for n in norms]
    out += [T(("attn", "q_kernel"), "self_attn.q_proj.weight", "qkv", (d, h, dh)),
            T(("attn", "k_kernel"), "self_attn.k_proj.weight", "qkv", (d, k, dh)),
            T(("attn", "v_kernel"), "self_attn.v_proj.weight", "qkv", (d, k, dh)),
            T(("attn", "o_kernel"), "self_attn.o_proj.weight", "o", (h, dh, d))]
    if c.attention_bias:
      out += [T(("attn", f"{p}_bias"), f"self_attn.{p}_proj.bias", "bias", (n, dh)) for p, n in (("q", h), ("k", k),
                                                                                                  ("v", k))]
    if c.qk_norm:
      out += [T(("attn", f"{p}_norm", "scale"), f"self_attn.{p}_norm.weight", "ident", (dh,)) for p in "qk"]
    return out

  def block_tensors(self, c: ModelConfig, kind: str) -> list[layouts.Tensor]:
    """One layer's feed-forward tensors for layers of `kind` (the dense gated MLP here)."""
    T = layouts.Tensor
    d, f = c.hidden_size, c.intermediate_size
    return [T(("mlp", "gate_kernel"), "mlp.gate_proj.weight", "t", (d, f)),
            T(("mlp", "up_kernel"), "mlp.up_proj.weight", "t", (d, f)),
            T(("mlp", "down_kernel"), "mlp.down_proj.weight", "t", (f, d))]

  def ignored_hf_tensor(self, c: ModelConfig, name: str) -> bool:
    """A checkpoint tensor transformers ignores too: a tied model's stored output head, RoPE buffers."""
    return (c.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

  def from_gguf(self, fields: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig from the generic fields rljax/models/gguf_io.py reads from llama.cpp metadata."""
    return ModelConfig(architecture=self.name, **fields, **self.fixed)

  # ---- costs --------------------------------------------------------------------------------

  def num_params(self, c: ModelConfig) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, f, v, hd = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    attn = d * hd * (c.num_heads * 2 + c.num_kv_heads * 2)
    if c.attention_bias:
      attn += hd * (c.num_heads + 2 * c.num_kv_heads)
    if c.qk_norm:
      attn += 2 * hd
    layer = attn + 3 * d * f + (4 if c.sandwich_norms else 2) * d
    return c.num_layers * layer + v * d * (1 if c.tie_word_embeddings else 2) + d

  def weight_flops_per_token(self, c: ModelConfig) -> float:
    """FLOPs of the forward's weight matmuls per token (projections, MLP, output head; 2 per multiply-add)."""
    per_layer = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + \
        3 * c.hidden_size * c.intermediate_size
    return 2.0 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)

  def attention_flops_per_token(self, c: ModelConfig, context: float) -> float:
    """FLOPs of q.k and p.v per token against `context` keys, all layers."""
    return 4.0 * context * c.num_heads * c.head_dim * c.num_layers

  def adapter_flops_per_token(self, c: ModelConfig) -> float:
    """FLOPs of the LoRA adapters' forward per token, (x A) B on each adapted projection (0 without LoRA)."""
    if c.lora is None:
      return 0.0
    d, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    sizes = {"q": d + q, "k": d + kv, "v": d + kv, "o": q + d, "gate": d + f, "up": d + f, "down": f + d}
    return 2.0 * c.lora.rank * c.num_layers * sum(sizes[t] for t in c.lora.targets)
