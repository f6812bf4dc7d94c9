"""Weight I/O of Hugging Face checkpoints: parity with transformers, round trips, sharding, errors."""
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest
from models_testlib import hf_logits, hf_model, max_diff_on_tokens, ragged_batch

import rljax
from rljax.errors import WeightsError
from rljax.models import io as model_io

FAMILIES = ("llama", "qwen2", "qwen3")
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """family -> (transformers model, its save_pretrained directory, reference logits on the ragged batch)."""
  ids, mask = ragged_batch()
  out = {}
  for family in FAMILIES:
    model = hf_model(family)
    d = str(tmp_path_factory.mktemp(f"hf_{family}"))
    model.save_pretrained(d)
    out[family] = (model, d, hf_logits(model, ids, mask))
  return out


@pytest.fixture(scope="module")
def policies(hf_dirs):
  return {family: rljax.load_pretrained(d) for family, (_, d, _) in hf_dirs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_matches_transformers(family, hf_dirs, policies):
  _, _, ref = hf_dirs[family]
  policy = policies[family]
  c = policy.config
  assert c.architecture == family
  assert c.tie_word_embeddings == (family == "qwen2")
  assert c.attention_bias == (family == "qwen2")
  assert c.qk_norm == (family == "qwen3")
  assert (c.rope_scaling is not None) == (family == "llama")
  assert ("lm_head" in policy.params) == (family != "qwen2")
  ids, mask = ragged_batch()
  logits = policy(ids, mask)
  assert logits.dtype == np.float32 and logits.shape == ref.shape
  assert max_diff_on_tokens(logits, ref, mask) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_in_transformers(family, hf_dirs, policies, tmp_path):
  import transformers
  _, _, ref = hf_dirs[family]
  out = model_io.save_pretrained(policies[family], tmp_path / "out")
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert model.config.tie_word_embeddings == (family == "qwen2")
  assert model.generation_config.eos_token_id == 2
  ids, mask = ragged_batch()
  assert max_diff_on_tokens(hf_logits(model, ids, mask), ref, mask) <= TOL
  # And back: the rljax reload is bit-identical.
  again = rljax.load_pretrained(out)
  assert again.config == policies[family].config
  jax.tree.map(np.testing.assert_array_equal, again.params, policies[family].params)


def test_sharded_safetensors_index_both_directions(hf_dirs, policies, tmp_path):
  import transformers
  model, _, ref = hf_dirs["llama"]
  # transformers writes shards + index -> rljax reads them.
  hf_sharded = tmp_path / "hf_sharded"
  model.save_pretrained(hf_sharded, max_shard_size="40KB")
  assert (hf_sharded / "model.safetensors.index.json").exists()
  assert len(list(hf_sharded.glob("model-*.safetensors"))) > 1
  loaded = rljax.load_pretrained(hf_sharded)
  jax.tree.map(np.testing.assert_array_equal, loaded.params, policies["llama"].params)

  # rljax writes shards + index -> transformers and rljax read them.
  out = tmp_path / "rljax_sharded"
  model_io.save_pretrained(policies["llama"], out, max_shard_size="40KB")
  shards = sorted(p.name for p in out.glob("model-*.safetensors"))
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
  assert not (out / "model.safetensors").exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  ids, mask = ragged_batch()
  assert max_diff_on_tokens(hf_logits(reloaded, ids, mask), ref, mask) <= TOL
  jax.tree.map(np.testing.assert_array_equal, rljax.load_pretrained(out).params, policies["llama"].params)

  # Saving again unsharded into the same directory leaves one checkpoint, not a mix.
  model_io.save_pretrained(policies["llama"], out)
  assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_transformers_4x_and_5x_config_fields(hf_dirs, policies, tmp_path):
  """5.x writes rope_parameters + dtype; 4.x wrote rope_theta + rope_scaling + torch_dtype."""
  _, src, _ = hf_dirs["llama"]
  cfg5 = json.loads(open(os.path.join(src, "config.json")).read())
  assert "rope_parameters" in cfg5 and "dtype" in cfg5  # what transformers 5 wrote
  cfg4 = {k: v for k, v in cfg5.items() if k not in ("rope_parameters", "dtype")}
  rope = dict(cfg5["rope_parameters"])
  cfg4["rope_theta"] = rope.pop("rope_theta")
  cfg4["rope_scaling"] = rope
  cfg4["torch_dtype"] = "float32"
  cfg4["transformers_version"] = "4.46.0"
  d4 = tmp_path / "v4"
  shutil.copytree(src, d4)
  (d4 / "config.json").write_text(json.dumps(cfg4))
  policy4 = rljax.load_pretrained(d4)
  assert policy4.config == policies["llama"].config
  assert policy4.config.rope_scaling.factor == 8.0 and policy4.config.rope_theta == 10000.0

  # Old-style `"type"` key and a default-rope 4.x Qwen2 config.
  assert rljax.ModelConfig.from_hf({**cfg4, "rope_scaling": {**rope, "type": "llama3"}}).rope_scaling is not None
  _, qsrc, _ = hf_dirs["qwen2"]
  q5 = json.loads(open(os.path.join(qsrc, "config.json")).read())
  q4 = {k: v for k, v in q5.items() if k not in ("rope_parameters", "dtype")}
  q4.update(rope_theta=1e6, rope_scaling=None, torch_dtype="bfloat16")
  assert rljax.ModelConfig.from_hf(q4) == rljax.ModelConfig.from_hf(q5) == policies["qwen2"].config

  # What rljax writes carries both spellings.
  written = policies["llama"].config.to_hf()
  assert written["rope_parameters"]["rope_type"] == "llama3" and written["rope_scaling"]["rope_type"] == "llama3"
  assert written["rope_theta"] == 10000.0 and written["dtype"] == written["torch_dtype"] == "float32"


def test_bfloat16_compute_close_to_float32(hf_dirs, policies, tmp_path):
  _, d, _ = hf_dirs["qwen3"]
  bf = rljax.load_pretrained(d, dtype="bfloat16", param_dtype="bfloat16")
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(bf.params))
  ids, mask = ragged_batch()
  ref = np.asarray(policies["qwen3"](ids, mask))
  out = bf(ids, mask)
  assert out.dtype == np.float32
  assert np.isfinite(np.asarray(out)).all()
  assert max_diff_on_tokens(out, ref, mask) <= 0.05 * float(np.abs(ref[mask]).max())
  assert (np.asarray(out).argmax(-1) == ref.argmax(-1))[mask].mean() >= 0.9

  # bf16 on disk: the tensors are BF16 and reload as the bf16-rounded fp32 params.
  from safetensors import safe_open
  out_dir = model_io.save_pretrained(policies["qwen3"], tmp_path / "bf16", dtype="bfloat16")
  with safe_open(os.path.join(out_dir, "model.safetensors"), "numpy") as f:
    assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
  assert json.loads(open(os.path.join(out_dir, "config.json")).read())["dtype"] == "bfloat16"
  again = rljax.load_pretrained(out_dir)
  want = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.bfloat16).astype(np.float32), policies["qwen3"].params)
  jax.tree.map(np.testing.assert_array_equal, again.params, want)


def test_sharded_forward_matches_single_device(hf_dirs, policies):
  from rljax.sharding import make_mesh
  assert jax.device_count() == 8
  mesh = make_mesh((2, 2, 2))
  single = policies["llama"]
  sharded = single.shard(mesh)
  specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(sharded.params)[0]}
  assert "tensor" in str(specs["['layers']['mlp']['gate_kernel']"])
  assert "fsdp" in str(specs["['layers']['mlp']['gate_kernel']"])
  ids, mask = ragged_batch()
  ref = np.asarray(single(ids, mask))
  out = np.asarray(sharded(ids, mask))
  np.testing.assert_allclose(out[mask], ref[mask], atol=2e-5, rtol=1e-5)
  # load_pretrained(mesh=...) places the same shardings straight away.
  _, d, _ = hf_dirs["llama"]
  direct = rljax.load_pretrained(d, mesh=mesh)
  jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim) or pytest.fail("sharding differs"),
               direct.params, sharded.params)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_load_reads_slices_into_place(family, hf_dirs, policies, tmp_path, monkeypatch):
  """load_pretrained(mesh=) builds each parameter from per-device slices of the files: bitwise the
  unsharded parameters, in the storage dtype, and no read covers a whole sharded tensor."""
  from rljax.models.policy import param_shardings
  from rljax.sharding import make_mesh
  _, d, _ = hf_dirs[family]
  reads = []
  original = model_io._SafetensorsCheckpoint.read

  def spy(self, name, index):
    out = original(self, name, index)
    reads.append((name, out.size, math.prod(self.shape(name))))
    return out

  monkeypatch.setattr(model_io._SafetensorsCheckpoint, "read", spy)
  for shape in [(2, 2, 2), (1, 2, 4)]:
    mesh = make_mesh(shape)
    reads.clear()
    sharded = rljax.load_pretrained(d, mesh=mesh)
    want = param_shardings(sharded.config, mesh)
    jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail("sharding differs"),
                 sharded.params, want)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 sharded.params, policies[family].params)
    # The MLP kernels are split over fsdp and tensor: every read is a part of its tensor.
    assert all(size < total for name, size, total in reads if "mlp" in name), shape
  # bf16 on disk, bf16 storage: read and kept as bf16.
  out = model_io.save_pretrained(policies[family], tmp_path / "bf16", dtype="bfloat16")
  mesh = make_mesh((1, 4, 2))
  half = rljax.load_pretrained(out, param_dtype="bfloat16", mesh=mesh)
  ref = rljax.load_pretrained(out, param_dtype="bfloat16")
  for a, b in zip(jax.tree.leaves(half.params), jax.tree.leaves(ref.params)):
    assert a.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_sharded_load_of_gguf_matches_unsharded():
  """GGUF (quantized) is dequantized per tensor on the host and placed by slices."""
  from rljax.sharding import make_mesh
  pytest.importorskip("gguf")
  try:
    ref = rljax.load_pretrained("smollm2-135m-instruct", tokenizer=False)
  except WeightsError as e:
    pytest.skip(str(e))
  sharded = rljax.load_pretrained("smollm2-135m-instruct", tokenizer=False, mesh=make_mesh((1, 8, 1)))
  emb = sharded.params["embedding"]
  assert len(emb.sharding.device_set) == 8 and emb.addressable_shards[0].data.shape[1] == emb.shape[1] // 8
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), sharded.params, ref.params)


# ---- bad input --------------------------------------------------------------------------------


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


def _edit_config(d, **changes):
  path = os.path.join(d, "config.json")
  cfg = json.loads(open(path).read())
  cfg.update(changes)
  open(path, "w").write(json.dumps(cfg))
  return d


def _bad_case(case, src, tmp):
  """Builds a broken checkpoint; returns (what to load, substrings the error must contain)."""
  if case == "missing_dir":
    return str(tmp / "no" / "such_dir"), [str(tmp / "no" / "such_dir"), "no such file"]
  if case == "unknown_name":
    return "not-a-model", ["not-a-model", "smollm2-135m-instruct"]
  if case == "no_weights":
    d = _copy(src, tmp / "c")
    os.remove(d / "model.safetensors")
    return d, [str(d), "model.safetensors"]
  if case == "corrupt_safetensors":
    d = _copy(src, tmp / "c")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return d, [str(d / "model.safetensors"), "not a valid safetensors file"]
  if case == "truncated_safetensors":
    d = _copy(src, tmp / "c")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    return d, [str(d / "model.safetensors"), "not a valid safetensors file"]
  if case == "corrupt_config":
    d = _copy(src, tmp / "c")
    (d / "config.json").write_text("{ model_type: llama")
    return d, [str(d / "config.json"), "not valid JSON"]
  if case == "unsupported_architecture":
    d = _edit_config(_copy(src, tmp / "c"), model_type="gpt2", architectures=["GPT2LMHeadModel"])
    return d, [str(d / "config.json"), "'gpt2'", "not supported"]
  if case == "shape_mismatch":
    d = _edit_config(_copy(src, tmp / "c"), intermediate_size=96)
    return d, [str(d / "model.safetensors"), "mlp.gate_proj.weight", "(128, 64)", "(96, 64)"]
  if case == "missing_tensor":
    d = _edit_config(_copy(src, tmp / "c"), num_hidden_layers=3)
    return d, [str(d / "model.safetensors"), "model.layers.2.", "missing"]
  if case == "unsupported_variant":  # Llama with mlp_bias: extra tensors rljax would silently drop
    import torch
    from safetensors.torch import load_file, save_file
    d = _copy(src, tmp / "c")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d, [str(d / "model.safetensors"), "mlp.up_proj.bias", "not part of rljax's llama model"]
  if case == "corrupt_gguf":
    p = tmp / "bad.gguf"
    p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 24)
    return p, [str(p), "not a valid GGUF file"]
  if case == "not_gguf":
    p = tmp / "weights.bin"
    p.write_bytes(b"\x00" * 16)
    return p, [str(p), "not a GGUF file"]
  raise ValueError(case)


@pytest.mark.parametrize("case", ["missing_dir", "unknown_name", "no_weights", "corrupt_safetensors",
                                  "truncated_safetensors", "corrupt_config", "unsupported_architecture",
                                  "shape_mismatch", "missing_tensor", "unsupported_variant", "corrupt_gguf",
                                  "not_gguf"])
def test_bad_input_gives_one_clear_weights_error(case, hf_dirs, tmp_path):
  target, needles = _bad_case(case, hf_dirs["llama"][1], tmp_path)
  with pytest.raises(WeightsError) as info:
    rljax.load_pretrained(target)
  message = str(info.value)
  for needle in needles:
    assert needle in message, (needle, message)
  assert info.value.__cause__ is None and "\n" not in message  # one error, one line, no chained traceback


def test_tokenizer_is_saved_and_optional(hf_dirs, policies, tmp_path):
  """A tokenizer with `save(dir)` is written next to the weights; sources without one give None."""
  assert all(p.tokenizer is None for p in policies.values())  # tiny dirs carry no tokenizer files

  class FakeTokenizer:
    def save(self, directory):
      with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write("{}")

  policy = policies["qwen2"].with_params(policies["qwen2"].params)
  policy.tokenizer = FakeTokenizer()
  out = model_io.save_pretrained(policy, tmp_path / "with_tok")
  assert os.path.isfile(os.path.join(out, "tokenizer.json"))
  assert rljax.load_pretrained(out, tokenizer=False).tokenizer is None


def test_bad_save_arguments(policies, tmp_path):
  with pytest.raises(WeightsError, match="dtype='int8'"):
    model_io.save_pretrained(policies["qwen2"], tmp_path / "x", dtype="int8")
  with pytest.raises(WeightsError, match="max_shard_size"):
    model_io.save_pretrained(policies["qwen2"], tmp_path / "x", max_shard_size="lots")
  assert model_io.parse_size("2GB") == 2 * 10**9 and model_io.parse_size("1MiB") == 2**20
