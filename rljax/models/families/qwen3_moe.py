"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k
norms, no biases) with a mixture of experts in place of the MLP (rljax/models/moe.py): a softmax
router `mlp.gate` picks the top `num_experts_per_tok` of `num_experts` SwiGLU experts per token,
their gates renormalised with `norm_topk_prob`. Layers listed in `mlp_only_layers`, or not a
multiple of `decoder_sparse_step` (counting from 1), keep a dense MLP of `intermediate_size`.

Weights: the hub's per-expert tensors `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`
are gathered into one [E, ...] parameter per projection (layouts "experts"), and written back
the same way: transformers 5.x reads and writes that layout (it fuses the experts only in memory).

Refused by name: `attention_bias`, the sliding window, a shared expert
(`shared_expert_intermediate_size`, Qwen2-MoE's), `num_experts=0`. LoRA: attention projections only.
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.errors import WeightsError
from rljax.models import layouts
from rljax.models.config import ModelConfig, MoeConfig
from rljax.models.families.qwen2 import refuse_sliding_window
from rljax.models.families.qwen3 import Qwen3
from rljax.models.layers import MLP

# Mixture-of-experts fields rljax's Qwen3-MoE does not implement.
_UNSUPPORTED = ("shared_expert_intermediate_size", "n_shared_experts", "n_routed_experts", "moe_num_experts")


class Qwen3Moe(Qwen3):
  name = "qwen3_moe"
  model_types = ("qwen3_moe",)
  hf_class = "Qwen3MoeForCausalLM"
  gguf_architectures = ()
  mixture_of_experts = True
  main_kind = "moe"
  lora_targets = ("q", "k", "v", "o")
  lora_note = (" (the experts and the router take no adapter; the dense layers' MLPs neither: "
               "docs/models.md#mixture-of-experts)")

  # ---- the model ------------------------------------------------------------------------------

  def layer_kinds(self, config: ModelConfig) -> tuple[str, ...]:
    return tuple("moe" if m else "dense" for m in config.moe_layers)

  def block(self, config: ModelConfig, kind: str):
    if kind == "moe":
      from rljax.models.moe import MoeBlock  # moe imports layers, which this module's base imports
      return "moe", MoeBlock
    return "mlp", MLP

  def random_defaults(self, num_layers: int, head_dim: int) -> dict[str, Any]:
    return dict(self.fixed, moe=MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=64,
                                          norm_topk_prob=True))

  # ---- HF config.json -------------------------------------------------------------------------

  def refuse_moe_fields(self, hf: Mapping[str, Any], source: str) -> None:
    bad = [f for f in _UNSUPPORTED if hf.get(f) not in (None, 0, [], False)]
    if bad:
      raise WeightsError(f"{source}: {', '.join(f'{f}={hf[f]!r}' for f in bad)} is not supported: rljax's "
                         "Qwen3-MoE has routed experts only (no shared expert).")

  def from_hf(self, hf: Mapping[str, Any], source: str):
    self.refuse_true(hf, source, "attention_bias", "Qwen3's attention_bias puts a bias on q, k, v and o_proj, "
                     "which rljax's Qwen3-MoE does not have.")
    refuse_sliding_window(self, hf, source)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    try:
      if not experts:
        raise WeightsError(f"{source}: num_experts={experts!r}: a Qwen3-MoE model needs routed experts (with 0 "
                           "every layer is dense; save it as model_type 'qwen3').")
      coef = float(hf.get("router_aux_loss_coef") or 0.0) if hf.get("output_router_logits") else 0.0
      moe = MoeConfig(num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]),
                      intermediate_size=int(hf["moe_intermediate_size"]),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      sparse_step=int(hf.get("decoder_sparse_step") or 1),
                      dense_layers=tuple(hf.get("mlp_only_layers") or ()), aux_loss_coef=coef)
    except KeyError as e:
      raise WeightsError(f"{source}: required field {e.args[0]!r} is missing from the model config.") from None
    return self.decoder_from_hf(hf, source, moe=moe)

  def to_hf(self, c: ModelConfig, dtype: str) -> dict[str, Any]:
    out = super().to_hf(c, dtype)
    m = c.moe
    out.update({
        "num_experts": m.num_experts,
        "num_local_experts": m.num_experts,   # transformers 5.x's name (num_experts is its alias)
        "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": m.intermediate_size,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": m.sparse_step,
        "mlp_only_layers": list(m.dense_layers),
        "output_router_logits": m.aux_loss_coef > 0,
        "router_aux_loss_coef": m.aux_loss_coef if m.aux_loss_coef > 0 else 0.001,   # transformers' default
    })
    return out

  # ---- weights --------------------------------------------------------------------------------

  def block_tensors(self, c: ModelConfig, kind: str) -> list[layouts.Tensor]:
    if kind != "moe":
      return super().block_tensors(c, kind)
    T = layouts.Tensor
    d, e, f = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    return [T(("moe", "router_kernel"), "mlp.gate.weight", "t", (d, e)),
            T(("moe", "gate_kernel"), "mlp.experts.{e}.gate_proj.weight", "experts", (e, d, f)),
            T(("moe", "up_kernel"), "mlp.experts.{e}.up_proj.weight", "experts", (e, d, f)),
            T(("moe", "down_kernel"), "mlp.experts.{e}.down_proj.weight", "experts", (e, f, d))]

  # ---- costs ----------------------------------------------------------------------------------

  def num_params(self, c: ModelConfig) -> int:
    """Every parameter, all experts included (`active_params` counts what one token uses)."""
    return self._params(c, c.moe.num_experts)

  def active_params(self, c: ModelConfig) -> int:
    """The parameters one token's forward uses: the router and the top-k experts of each MoE layer."""
    return self._params(c, c.moe.experts_per_token)

  def _params(self, c: ModelConfig, experts: int) -> int:
    d, v, hd = c.hidden_size, c.vocab_size, c.head_dim
    attn = d * hd * (c.num_heads * 2 + c.num_kv_heads * 2) + 2 * hd
    moe = sum(c.moe_layers)
    ffn = moe * (d * c.moe.num_experts + 3 * experts * d * c.moe.intermediate_size) + \
        (c.num_layers - moe) * 3 * d * c.intermediate_size
    return c.num_layers * (attn + 2 * d) + ffn + v * d * (1 if c.tie_word_embeddings else 2) + d

  def weight_flops_per_token(self, c: ModelConfig) -> float:
    """Active parameters only: the router and k experts' SwiGLU per MoE layer, the dense MLP elsewhere."""
    d = c.hidden_size
    attn = d * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    moe = sum(c.moe_layers)
    ffn = moe * (d * c.moe.num_experts + 3 * c.moe.experts_per_token * d * c.moe.intermediate_size) + \
        (c.num_layers - moe) * 3 * d * c.intermediate_size
    return 2.0 * (c.num_layers * attn + ffn + c.vocab_size * d)


FAMILIES = (Qwen3Moe(),)
