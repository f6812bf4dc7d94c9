"""LoRA adapters exported for PEFT (rljax/models/lora_io.py), checked against peft and transformers.

Tiny random models of four kinds (Llama with an untied head, Llama tied, Qwen2 with q/k/v biases,
Gemma 2 with soft-caps and a 4-token sliding window), LoRA of rank 3 (not a head count, so a
rank/heads axis mix-up cannot pass) and alpha 5 (scale 5/3) on all seven projections, float32,
random adapters with non-zero B. The base is written by `save_pretrained`, the adapter by
`save_peft_adapter`; transformers + `peft.PeftModel.from_pretrained` must then compute rljax's
adapted logits on a ragged batch (full, left-padded and right-padded rows) within 1e-4 (fp32
rounding of two implementations; logits are O(1)). Also: the merged export, peft's
`merge_and_unload`, the file layout against peft's own writer, and exact round trips.
"""
import json
import os

import jax
import numpy as np
import pytest
from models_testlib import hf_config, hf_logits, max_diff_on_tokens, ragged_batch

from rljax.errors import ConfigError, WeightsError
from rljax.models import LoraConfig, ModelConfig, Policy, init_params, lora
from rljax.models.io import save_pretrained
from rljax.models.lora_io import (
  ADAPTER_CONFIG_FILE,
  ADAPTER_WEIGHTS_FILE,
  hf_to_lora,
  load_peft_adapter,
  lora_to_hf,
  save_peft_adapter,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = ("llama", "llama_tied", "qwen2", "gemma2")
LORA = LoraConfig(rank=3, alpha=5.0)
TOL = 1e-4
HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _gemma2_hf_config():
  """tests/test_gemma.py's tiny Gemma 2: soft-caps that bend, query_pre_attn_scalar != head_dim, window 4."""
  return transformers.Gemma2Config(
      vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
      sliding_window=4, bos_token_id=2, eos_token_id=None, pad_token_id=0, tie_word_embeddings=True,
      attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def model_config(family: str, lora_config: LoraConfig | None = LORA) -> ModelConfig:
  if family == "gemma2":
    c = ModelConfig.from_hf(_gemma2_hf_config().to_dict())
  else:
    c = ModelConfig.from_hf(hf_config("qwen2" if family == "qwen2" else "llama").to_dict())
    if family == "llama_tied":
      c = c.replace(tie_word_embeddings=True)
  return c.replace(lora=lora_config)


def random_base(config: ModelConfig, seed: int = 0):
  """Base weights far from init: N(0, 0.05) kernels / embeddings / biases, norm scales in [0.5, 1.5]
  (Gemma: offsets N(0, 0.3))."""
  params = init_params(config.replace(lora=None), jax.random.key(seed))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  out = []
  for (path, x), k in zip(leaves, keys):
    if path[-1].key == "scale":
      x = (0.3 * jax.random.normal(k, x.shape) if config.norm_offset
           else jax.random.uniform(k, x.shape, minval=0.5, maxval=1.5))
    else:
      x = 0.05 * jax.random.normal(k, x.shape)
    out.append(np.asarray(x, np.float32))
  return jax.tree_util.tree_unflatten(treedef, out)


def random_adapters(config: ModelConfig, seed: int = 1, scale: float = 0.1):
  """PEFT-style A (uniform, 1/sqrt(fan_in)) and B ~ N(0, scale): B = 0 would test nothing."""
  adapters = jax.device_get(lora.init_adapters(config, jax.random.key(seed)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  out = [np.asarray(scale * jax.random.normal(k, x.shape) if path[-1].key.endswith("_lora_b") else x, np.float32)
         for (path, x), k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, out)


def read_json(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def hf_load(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def peft_load(base_dir, adapter_dir):
  return peft.PeftModel.from_pretrained(hf_load(base_dir), adapter_dir).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
  """A family's config, base, adapters, their PEFT export, a ragged batch and rljax's logits on it."""
  family = request.param
  config = model_config(family)
  base, adapters = random_base(config), random_adapters(config)
  root = tmp_path_factory.mktemp(family)
  base_dir = save_pretrained(Policy(config.replace(lora=None), base), root / "base", dtype="float32")
  adapter_dir = save_peft_adapter(config, adapters, root / "adapter", base_model_name_or_path=str(base_dir))
  ids, mask = ragged_batch(seed=3, batch=3, length=10, vocab=config.vocab_size)
  logits = np.asarray(Policy(config, lora.join(base, adapters))(ids, mask))
  base_logits = np.asarray(Policy(config.replace(lora=None), base)(ids, mask))
  return dict(family=family, config=config, base=base, adapters=adapters, root=root, base_dir=base_dir,
              adapter_dir=adapter_dir, ids=ids, mask=mask, logits=logits, base_logits=base_logits)


def test_peft_runs_the_exported_adapter_like_rljax(exported):
  e = exported
  assert e["mask"][1, 0] == 0 and e["mask"][1].any()   # a left-padded row is in the batch
  assert max_diff_on_tokens(e["logits"], e["base_logits"], e["mask"]) > 0.05   # the adapter matters
  model = peft_load(e["base_dir"], e["adapter_dir"])
  diff = max_diff_on_tokens(hf_logits(model, e["ids"], e["mask"]), e["logits"], e["mask"])
  print(f"\n[{e['family']}] PEFT adapter vs rljax adapted logits: max |diff| = {diff:.2e}")
  assert diff <= TOL


def test_merged_export_and_peft_merge_and_unload_match(exported):
  e = exported
  c = e["config"]
  merged = lora.merge(c, e["base"], e["adapters"])
  merged_dir = save_pretrained(Policy(c.replace(lora=None), merged), e["root"] / "merged", dtype="float32")
  plain = max_diff_on_tokens(hf_logits(hf_load(merged_dir), e["ids"], e["mask"]), e["logits"], e["mask"])
  unloaded = peft_load(e["base_dir"], e["adapter_dir"]).merge_and_unload()
  assert not isinstance(unloaded, peft.PeftModel)
  folded = max_diff_on_tokens(hf_logits(unloaded, e["ids"], e["mask"]), e["logits"], e["mask"])
  print(f"\n[{e['family']}] merged export {plain:.2e}, peft merge_and_unload {folded:.2e} (vs rljax adapted)")
  assert plain <= TOL
  assert folded <= TOL


def test_round_trip_is_exact_and_files_are_float32(exported):
  e = exported
  back = jax.device_get(load_peft_adapter(e["config"], e["adapter_dir"]))
  assert jax.tree.structure(back) == jax.tree.structure(e["adapters"])
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(e["adapters"])):
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
  from safetensors import safe_open
  with safe_open(os.path.join(e["adapter_dir"], ADAPTER_WEIGHTS_FILE), framework="numpy") as f:
    assert {f.get_tensor(k).dtype for k in list(f.keys())} == {np.dtype(np.float32)}
    assert len(f.keys()) == 2 * len(HF_MODULES) * e["config"].num_layers


def test_layout_matches_peft_own_writer_and_peft_files_load(tmp_path):
  """peft's `save_pretrained` of a LoRA with the same r / alpha / targets on the same base writes
  the same tensor names and shapes and the config fields rljax relies on; and an adapter written
  by peft (B set at random through torch) loads into rljax with PEFT's logits (1e-4)."""
  config = model_config("qwen2")
  base = random_base(config, seed=5)
  base_dir = save_pretrained(Policy(config.replace(lora=None), base), tmp_path / "base", dtype="float32")
  ours = save_peft_adapter(config, random_adapters(config, seed=6), tmp_path / "ours")
  lc = peft.LoraConfig(r=LORA.rank, lora_alpha=5, lora_dropout=0.0, target_modules=list(HF_MODULES),
                       task_type="CAUSAL_LM")
  model = peft.get_peft_model(hf_load(base_dir), lc)
  torch.manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.normal_(0.0, 0.1)
  model.save_pretrained(tmp_path / "theirs")
  from safetensors import safe_open

  def layout(d):
    with safe_open(os.path.join(d, ADAPTER_WEIGHTS_FILE), framework="numpy") as f:
      return {k: (f.get_tensor(k).shape, f.get_tensor(k).dtype) for k in list(f.keys())}

  assert layout(ours) == layout(tmp_path / "theirs")
  mine = read_json(os.path.join(ours, ADAPTER_CONFIG_FILE))
  theirs = read_json(tmp_path / "theirs" / ADAPTER_CONFIG_FILE)
  for field in ("peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "use_rslora", "use_dora",
                "inference_mode", "lora_bias"):
    assert mine[field] == theirs[field], field
  assert sorted(mine["target_modules"]) == sorted(theirs["target_modules"])

  adapters = load_peft_adapter(config, tmp_path / "theirs")
  ids, mask = ragged_batch(seed=4, batch=3, length=10, vocab=config.vocab_size)
  rl = np.asarray(Policy(config, lora.join(base, adapters))(ids, mask))
  diff = max_diff_on_tokens(hf_logits(model.eval(), ids, mask), rl, mask)
  print(f"\n[qwen2] peft-written adapter loaded by rljax vs PEFT logits: max |diff| = {diff:.2e}")
  assert diff <= TOL
  assert max_diff_on_tokens(rl, np.asarray(Policy(config.replace(lora=None), base)(ids, mask)), mask) > 0.05


def test_subset_of_targets_round_trips_and_runs_in_peft(tmp_path):
  config = model_config("llama", LoraConfig(rank=2, alpha=3.0, targets=("q", "v")))
  base, adapters = random_base(config), random_adapters(config)
  assert set(adapters["layers"]) == {"attn"} and set(adapters["layers"]["attn"]) == {
      "q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b"}
  base_dir = save_pretrained(Policy(config.replace(lora=None), base), tmp_path / "base")
  out = save_peft_adapter(config, adapters, tmp_path / "adapter")
  assert read_json(os.path.join(out, ADAPTER_CONFIG_FILE))["target_modules"] == ["q_proj", "v_proj"]
  back = jax.device_get(load_peft_adapter(config, out))
  jax.tree.map(np.testing.assert_array_equal, back, adapters)
  ids, mask = ragged_batch(seed=5, batch=3, length=10, vocab=config.vocab_size)
  rl = np.asarray(Policy(config, lora.join(base, adapters))(ids, mask))
  diff = max_diff_on_tokens(hf_logits(peft_load(base_dir, out), ids, mask), rl, mask)
  print(f"\n[llama q,v] PEFT adapter vs rljax adapted logits: max |diff| = {diff:.2e}")
  assert diff <= TOL


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
  config = model_config("llama")
  adapters = random_adapters(config)
  return config, adapters, save_peft_adapter(config, adapters, tmp_path_factory.mktemp("small") / "adapter")


@pytest.mark.parametrize("change, message", [
    ({"rank": 4}, "rank r=3 but config.lora.rank=4"),
    ({"alpha": 8.0}, "lora_alpha=5 but config.lora.alpha=8.0"),
    ({"targets": ("q", "k", "v", "o")}, "config.lora.targets=['q', 'k', 'v', 'o']"),
])
def test_a_config_that_differs_from_the_adapter_is_refused(small_export, change, message):
  config, _, path = small_export
  other = config.replace(lora=LoraConfig(**{"rank": 3, "alpha": 5.0, "targets": LORA.targets, **change}))
  with pytest.raises(WeightsError, match=message.replace("[", r"\[").replace("]", r"\]")):
    load_peft_adapter(other, path)


def test_bad_files_and_trees_are_refused(small_export, tmp_path):
  config, adapters, path = small_export
  tensors = lora_to_hf(config, adapters)
  key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
  assert tensors[key].shape == (3, config.intermediate_size)

  wrong = dict(tensors, **{key: tensors[key][:2]})   # a rank-2 matrix under a rank-3 config
  with pytest.raises(WeightsError, match=r"down_proj.lora_A.weight' has shape \(2, 128\), expected \(3, 128\)"):
    hf_to_lora(config, wrong)
  with pytest.raises(WeightsError, match="layers.1.mlp.down_proj.lora_A.weight' is missing"):
    hf_to_lora(config, {k: v for k, v in tensors.items() if k != key})
  extra = dict(tensors, **{"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(64)})
  with pytest.raises(WeightsError, match="lora_magnitude_vector"):
    hf_to_lora(config, extra)

  with pytest.raises(WeightsError, match="adapter_config.json: file not found"):
    load_peft_adapter(config, tmp_path)
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / ADAPTER_CONFIG_FILE).write_text(json.dumps(read_json(os.path.join(path, ADAPTER_CONFIG_FILE))))
  with pytest.raises(WeightsError, match="adapter_model.safetensors: file not found"):
    load_peft_adapter(config, broken)
  (broken / ADAPTER_WEIGHTS_FILE).write_bytes(b"not safetensors")
  with pytest.raises(WeightsError, match="not a valid safetensors file"):
    load_peft_adapter(config, broken)
  data = read_json(os.path.join(path, ADAPTER_CONFIG_FILE))
  (broken / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(data, use_rslora=True)))
  with pytest.raises(WeightsError, match="use_rslora=True is not supported"):
    load_peft_adapter(config, broken)

  with pytest.raises(WeightsError, match="q_lora_b has shape"):
    lora_to_hf(config, jax.tree_util.tree_map_with_path(
        lambda p, x: x[:, :, :2] if p[-1].key == "q_lora_b" else x, adapters))
  with pytest.raises(ConfigError, match="config.lora is None"):
    save_peft_adapter(config.replace(lora=None), adapters, tmp_path / "x")
