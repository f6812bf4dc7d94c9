"""Shared helpers of the model tests: tiny random transformers models, ragged batches, GGUF writing."""
from __future__ import annotations

import os

import numpy as np

VOCAB = 256
# Llama 3 RoPE scaling chosen so that, with head_dim 16 and theta 1e4, the 8 frequencies
# fall in all three regimes (unscaled, interpolated, scaled).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_config(family: str):
  """A tiny random-model config of each family (transformers 5.x objects)."""
  import transformers
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2)
  if family == "llama":  # Llama 3 RoPE scaling, untied output head
    return transformers.LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
  if family == "qwen2":  # q/k/v biases, tied embeddings
    return transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                    tie_word_embeddings=True)
  if family == "qwen3":  # q/k RMSNorm, head_dim != hidden / heads
    return transformers.Qwen3Config(**common, head_dim=32, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e6},
                                    tie_word_embeddings=False)
  raise ValueError(family)


def hf_model(family: str, seed: int = 0):
  """A transformers model with every tensor random (norm scales around 1, biases non-zero)."""
  return hf_model_from_config(hf_config(family), seed)


def hf_model_from_config(config, seed: int = 0):
  """`hf_model` for a given transformers config object."""
  import torch
  import transformers
  torch.manual_seed(seed)
  config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
  return randomize_weights(model)   # continues the stream seeded above


def randomize_weights(model, seed: int | None = None):
  """Every tensor of a transformers `model` drawn again (norm scales in [0.5, 1.5], the rest
  N(0, 0.05^2)), from `seed` or torch's current stream; returns it in eval mode."""
  import torch
  if seed is not None:
    torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.05)
  return model.eval()


def ragged_batch(seed: int = 0, batch: int = 4, length: int = 12, vocab: int = VOCAB):
  """(input_ids [B, T] int64, mask [B, T] bool): full, left-padded, right-padded and both rows."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(3, vocab, size=(batch, length)).astype(np.int64)
  mask = np.ones((batch, length), bool)
  if batch > 1:
    mask[1, :4] = False          # left padding
  if batch > 2:
    mask[2, length - 5:] = False  # right padding
  if batch > 3:
    mask[3, :2] = False
    mask[3, length - 3:] = False
  ids[~mask] = 0
  return ids, mask


def left_padded_prompts(lengths, vocab: int, low: int = 1, seed: int = 0):
  """(ids [B, max(lengths)] int32, mask [B, max(lengths)] bool): one left-padded prompt of random
  tokens in [low, vocab) per length, the sampler's input layout."""
  rng = np.random.default_rng(seed)
  width = max(lengths)
  ids = np.zeros((len(lengths), width), np.int32)
  mask = np.zeros((len(lengths), width), bool)
  for i, n in enumerate(lengths):
    ids[i, width - n:] = rng.integers(low, vocab, n)
    mask[i, width - n:] = True
  return ids, mask


def positions(mask: np.ndarray) -> np.ndarray:
  return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """transformers logits [B, T, V] with explicit positions = cumsum(mask) - 1."""
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask.astype(np.int64)),
                position_ids=torch.as_tensor(positions(mask)))
  return out.logits.float().numpy()


def max_diff_on_tokens(a, b, mask) -> float:
  return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))[mask].max())


# ---- GGUF writing (the llama.cpp conventions, implemented independently of rljax) -------------


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's q/k row order: per head, rows (0, Dh/2, 1, Dh/2 + 1, ...)."""
  dh = w.shape[0] // heads
  out = np.empty_like(w)
  for h in range(heads):
    block = w[h * dh:(h + 1) * dh]
    out[h * dh:(h + 1) * dh:2] = block[:dh // 2]
    out[h * dh + 1:(h + 1) * dh:2] = block[dh // 2:]
  return out


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def byte_level_vocab(size: int):
  """(tokens, token types, merges) of a small but valid byte-level BPE vocabulary of `size` tokens."""
  import itertools
  import string
  tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 127)] + ["\u0120"]
  types = [3, 3, 3] + [1] * (len(tokens) - 3)
  merges = []
  for a, b in itertools.product(string.ascii_lowercase, repeat=2):
    if len(tokens) == size:
      break
    tokens.append(a + b)
    types.append(1)
    merges.append(f"{a} {b}")
  return tokens, types, merges


def round_weights_like(model, qtype_name: str):
  """Replaces each 2-D weight of `model` by dequantize(quantize(w)): what a `qtype` GGUF holds."""
  import torch
  from gguf import GGMLQuantizationType
  from gguf.quants import dequantize, quantize
  qtype = GGMLQuantizationType[qtype_name]
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim == 2:
        w = p.detach().numpy()
        p.copy_(torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape)))
  return model


def write_gguf(model, path: str, arch: str | None = None, metadata_overrides: dict | None = None,
               qtype_name: str = "F32") -> str:
  """Writes a transformers model as a GGUF file the way llama.cpp's converter lays it out.

  2-D weights are stored as `qtype_name` (F32, F16, BF16, Q8_0, ...); norms and biases as F32.
  """
  import gguf
  import torch
  from gguf.quants import quantize
  qtype = gguf.GGMLQuantizationType[qtype_name]
  cfg = model.config
  arch = arch or cfg.model_type
  w = gguf.GGUFWriter(path, arch)
  heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
  meta = {
      "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
      "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
      "attention.head_count": heads, "attention.head_count_kv": kv,
      "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "rope.freq_base": cfg.rope_parameters["rope_theta"],
      "attention.key_length": head_dim, "attention.value_length": head_dim,
  }
  meta.update(metadata_overrides or {})
  for key, value in meta.items():
    if isinstance(value, float):
      w.add_float32(f"{arch}.{key}", value)
    else:
      w.add_uint32(f"{arch}.{key}", int(value))
  tokens, types, merges = byte_level_vocab(cfg.vocab_size)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(cfg.bos_token_id)
  w.add_eos_token_id(cfg.eos_token_id)

  state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  if cfg.rope_parameters.get("rope_type") == "llama3":
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))

  def put(name, t):
    t = np.ascontiguousarray(t, np.float32)
    if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
      w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(name, t)

  put("token_embd.weight", state["model.embed_tokens.weight"])
  put("output_norm.weight", state["model.norm.weight"])
  if not cfg.tie_word_embeddings:
    put("output.weight", state["lm_head.weight"])
  for i in range(cfg.num_hidden_layers):
    for suffix, name in _TO_GGUF.items():
      t = state.get(f"model.layers.{i}.{suffix}")
      if t is None:
        continue
      if arch == "llama" and suffix.startswith("self_attn.q_proj."):
        t = llamacpp_permute(t, heads)
      elif arch == "llama" and suffix.startswith("self_attn.k_proj."):
        t = llamacpp_permute(t, kv)
      put(f"blk.{i}.{name}", t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def truncate(path: str, keep: float = 0.5) -> str:
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(int(size * keep))
  return path


def tiny_retool_config(tmp_path, max_new_tokens: int = 48):
  """configs/retool_tiny.py (multi-turn python tool use) on a tiny random model: 2 prompts x 2
  samples, 16-token segments, output in `tmp_path`, no progress bar or TensorBoard."""
  from rljax.configs import retool_tiny
  c = retool_tiny.get_config()
  c.model.path = "random"
  c.tokenizer = "smollm2-135m-instruct"
  c.model.random.update(dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8))
  c.sampling.max_new_tokens = max_new_tokens
  c.tools.segment_tokens = 16
  c.train.prompts_per_step = 2
  c.sampling.num_samples = 2
  c.output.dir = str(tmp_path)
  c.output.progress = False
  c.output.tensorboard = False
  return c
