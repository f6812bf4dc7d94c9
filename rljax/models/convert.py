"""Mapping between Hugging Face tensor names/layouts and rljax's parameter tree.

HF stores linear weights as [out, in]; rljax stores kernels as [in, ..., out] with
heads split out, and stacks layers on a leading axis (for `nn.scan`).

Norms: rljax's `post_attn_norm` is the norm before the MLP in every family: HF's
`post_attention_layernorm` for Llama / Qwen, `pre_feedforward_layernorm` for Gemma, whose
`post_attention_layernorm` / `post_feedforward_layernorm` normalise the attention / MLP outputs
(rljax's `attn_out_norm` / `mlp_out_norm`, present with `sandwich_norms`). Gemma's norm weights
are stored as the offset w of the (1 + w) scale, in HF and in rljax alike.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from rljax.errors import WeightsError
from rljax.models.config import ModelConfig


def _layer_specs(c: ModelConfig):
  """(rljax path within a layer, HF suffix, to_rljax(w), to_hf(w)) for one layer's tensors."""
  d, h, k, dh, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size

  def qkv(heads):
    return (lambda w: w.reshape(heads, dh, d).transpose(2, 0, 1),
            lambda w: w.transpose(1, 2, 0).reshape(heads * dh, d))

  def bias(heads):
    return (lambda w: w.reshape(heads, dh), lambda w: w.reshape(heads * dh))

  ident = (lambda w: w, lambda w: w)
  transpose = (lambda w: w.T, lambda w: w.T)
  pre_mlp = "pre_feedforward_layernorm.weight" if c.sandwich_norms else "post_attention_layernorm.weight"
  specs = [
      (("input_norm", "scale"), "input_layernorm.weight", *ident),
      (("post_attn_norm", "scale"), pre_mlp, *ident),
      (("attn", "q_kernel"), "self_attn.q_proj.weight", *qkv(h)),
      (("attn", "k_kernel"), "self_attn.k_proj.weight", *qkv(k)),
      (("attn", "v_kernel"), "self_attn.v_proj.weight", *qkv(k)),
      (("attn", "o_kernel"), "self_attn.o_proj.weight",
       lambda w: w.reshape(d, h, dh).transpose(1, 2, 0), lambda w: w.transpose(2, 0, 1).reshape(d, h * dh)),
      (("mlp", "gate_kernel"), "mlp.gate_proj.weight", *transpose),
      (("mlp", "up_kernel"), "mlp.up_proj.weight", *transpose),
      (("mlp", "down_kernel"), "mlp.down_proj.weight", *transpose),
  ]
  if c.attention_bias:
    specs += [(("attn", "q_bias"), "self_attn.q_proj.bias", *bias(h)),
              (("attn", "k_bias"), "self_attn.k_proj.bias", *bias(k)),
              (("attn", "v_bias"), "self_attn.v_proj.bias", *bias(k))]
  if c.qk_norm:
    specs += [(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", *ident),
              (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", *ident)]
  if c.sandwich_norms:
    specs += [(("attn_out_norm", "scale"), "post_attention_layernorm.weight", *ident),
              (("mlp_out_norm", "scale"), "post_feedforward_layernorm.weight", *ident)]
  return specs


def _expected_hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
  d, h, k, dh, f, v = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
  per_layer = {
      "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
      "self_attn.q_proj.weight": (h * dh, d), "self_attn.k_proj.weight": (k * dh, d),
      "self_attn.v_proj.weight": (k * dh, d), "self_attn.o_proj.weight": (d, h * dh),
      "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
      "self_attn.q_proj.bias": (h * dh,), "self_attn.k_proj.bias": (k * dh,), "self_attn.v_proj.bias": (k * dh,),
      "self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,),
  }
  if c.sandwich_norms:
    per_layer.update({"pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,)})
  out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
  for i in range(c.num_layers):
    for suffix, shape in per_layer.items():
      out[f"model.layers.{i}.{suffix}"] = shape
  return out


def hf_to_params(c: ModelConfig, get: Callable[[str], np.ndarray], names: set[str], source: str = "weights"):
  """Builds the rljax param tree from HF-named tensors.

  `get(name)` returns a numpy array; `names` is the set of available tensor names.
  Raises WeightsError naming the file and the tensor on a missing tensor or shape mismatch.
  """
  expected = _expected_hf_shapes(c)

  def fetch(name):
    if name not in names:
      raise WeightsError(f"{source}: tensor {name!r} is missing; the weights do not match config "
                         f"(architecture={c.architecture}, layers={c.num_layers}).")
    w = np.asarray(get(name))
    if tuple(w.shape) != expected[name]:
      raise WeightsError(f"{source}: tensor {name!r} has shape {tuple(w.shape)} but the config implies "
                         f"{expected[name]}; config.json and the weights disagree.")
    return w.astype(np.float32) if w.dtype != np.float32 else w

  dtype = np.dtype(c.storage_dtype)
  layers: dict = {}
  for path, suffix, to_rljax, _ in _layer_specs(c):
    stacked = np.stack([to_rljax(fetch(f"model.layers.{i}.{suffix}")) for i in range(c.num_layers)])
    node = layers
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = stacked.astype(dtype)
  params = {
      "embedding": fetch("model.embed_tokens.weight").astype(dtype),
      "layers": layers,
      "final_norm": {"scale": fetch("model.norm.weight").astype(dtype)},
  }
  if not c.tie_word_embeddings:
    params["lm_head"] = fetch("lm_head.weight").T.astype(dtype)
  return params


def params_to_hf(c: ModelConfig, params, dtype=np.float32) -> dict[str, np.ndarray]:
  """rljax params -> HF-named numpy tensors (contiguous, in `dtype`)."""
  out: dict[str, np.ndarray] = {}

  def put(name, w):
    out[name] = np.ascontiguousarray(np.asarray(w, dtype=np.float32).astype(dtype))

  put("model.embed_tokens.weight", params["embedding"])
  put("model.norm.weight", params["final_norm"]["scale"])
  if not c.tie_word_embeddings:
    put("lm_head.weight", np.asarray(params["lm_head"]).T)
  for path, suffix, _, to_hf in _layer_specs(c):
    node = params["layers"]
    for p in path:
      node = node[p]
    stacked = np.asarray(node, dtype=np.float32)
    for i in range(c.num_layers):
      put(f"model.layers.{i}.{suffix}", to_hf(stacked[i]))
  return out


def check_param_tree(c: ModelConfig, params: Mapping, source: str = "params") -> None:
  """Raises WeightsError if `params` does not have the structure/shapes `c` implies."""
  import jax
  from rljax.models.policy import init_params
  want = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  got_flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in want_flat.items():
    name = jax.tree_util.keystr(path)
    if path not in got_flat:
      raise WeightsError(f"{source}: parameter {name} is missing.")
    if tuple(got_flat[path].shape) != tuple(leaf.shape):
      raise WeightsError(f"{source}: parameter {name} has shape {tuple(got_flat[path].shape)}, expected {leaf.shape}.")
  extra = set(got_flat) - set(want_flat)
  if extra:
    raise WeightsError(f"{source}: unexpected parameters {sorted(jax.tree_util.keystr(p) for p in extra)[:5]}.")
