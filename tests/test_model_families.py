"""The model-family registry (rljax/models/families/): lookups, config.json round trips, the fields
refused by name, and the extension point itself: a family defined in this file alone (a
feed-forward block with an auxiliary loss) loads, exports, runs, and trains through the learner,
whose loss carries the auxiliary loss."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from models_testlib import hf_model, write_gguf
from test_packing import G, LP, P, T, _rollout

import rljax
from rljax.errors import ConfigError, WeightsError
from rljax.models import LoraConfig, ModelConfig, Policy, apply_model, families, gguf_io, init_params
from rljax.models.families.llama import Llama
from rljax.models.layers import gated_mlp
from rljax.rl import LossConfig
from rljax.rollout import SamplingParams
from rljax.trainer.optim import make_optimizer
from rljax.trainer.state import TrainState
from rljax.trainer.step import StepSpec, make_update_fn

DENSE = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8)


def _hf(model_type, **fields):
  return {**dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8), **fields}


def test_registry_lookups_and_errors():
  assert set(DENSE) <= set(families.names())
  for name in DENSE:
    family = families.get(name)
    assert family.name == name
    for model_type in family.model_types:
      assert families.for_model_type(model_type, "c.json") is family
  assert families.for_gguf("qwen3", "m.gguf") is families.get("qwen3")
  with pytest.raises(ConfigError, match=r"model.architecture='gpt2' is not supported; use one of \("):
    families.get("gpt2")
  with pytest.raises(WeightsError, match=r"c.json: model_type='gpt2' is not supported; rljax supports .*qwen3"):
    families.for_model_type("gpt2", "c.json")
  with pytest.raises(WeightsError, match=r"c.json: model_type='gemma3' is the multimodal Gemma 3"):
    families.for_model_type("gemma3", "c.json")
  with pytest.raises(WeightsError, match=r"m.gguf: GGUF architecture 'gemma2' is not supported; rljax supports llama"):
    families.for_gguf("gemma2", "m.gguf")


@pytest.mark.parametrize("name", DENSE)
def test_config_json_round_trip_through_transformers(name):
  """Each family's random model -> config.json -> transformers' config class -> back, unchanged."""
  transformers = pytest.importorskip("transformers")
  family = families.get(name)
  c = ModelConfig(architecture=name, **SHAPE, eos_token_ids=(2,), bos_token_id=1,
                  **family.random_defaults(SHAPE["num_layers"], SHAPE["head_dim"]))
  hf = c.to_hf()
  assert hf["architectures"] == [family.hf_class] and hf["model_type"] == family.model_types[0]
  assert ModelConfig.from_hf(hf) == c
  again = transformers.AutoConfig.for_model(**hf).to_dict()   # what transformers keeps of it
  assert ModelConfig.from_hf(again) == c


_MOE = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1)


@pytest.mark.parametrize("hf,needles", [
    # Qwen3-30B-A3B's MoE fields under model_type qwen3: a dense 3B model would load silently.
    (_hf("qwen3", **_MOE), ["num_experts=128", "moe_intermediate_size=768", "not a dense model"]),
    (_hf("llama", num_local_experts=8), ["num_local_experts=8"]),
    (_hf("qwen3", attention_bias=True), ["attention_bias=True", "o_proj"]),
    (_hf("llama", attention_bias=True), ["attention_bias=True"]),
    (_hf("llama", mlp_bias=True), ["mlp_bias=True"]),
    (_hf("gemma2", attention_bias=True), ["attention_bias=True"]),
    (_hf("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1), ["use_sliding_window=true",
                                                                                      "max_window_layers=1"]),
    (_hf("qwen3", use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
     ["use_sliding_window=true"]),
    (_hf("llama", hidden_act="gelu"), ["hidden_act='gelu'"]),
    (_hf("gemma3_text", hidden_activation="relu"), ["hidden_activation='relu'"]),
    (_hf("qwen2", quantization_config={"quant_method": "awq", "bits": 4}), ["quantization_config", "'awq'"]),
    (_hf("llama", partial_rotary_factor=0.5), ["partial_rotary_factor=0.5"]),
    (_hf("gemma2", rope_scaling={"rope_type": "linear", "factor": 2.0}), ["'linear'", "gemma2"]),
    (_hf("gemma3_text", rope_parameters={"full_attention": {"rope_type": "default"},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     ["sliding_attention.rope_type='linear'"]),
    (_hf("gemma3_text", use_bidirectional_attention=True), ["use_bidirectional_attention=True"]),
])
def test_fields_that_change_the_computation_are_refused_by_name(hf, needles):
  with pytest.raises(WeightsError) as info:
    ModelConfig.from_hf(hf, source="d/config.json")
  message = str(info.value)
  assert message.startswith("d/config.json: ") and "\n" not in message
  for needle in needles:
    assert needle in message, (needle, message)


def test_odd_head_dim_is_refused():
  with pytest.raises(ConfigError, match="model.head_dim=7 must be even"):
    ModelConfig.from_hf(_hf("qwen3", head_dim=7))


def test_fields_that_do_not_change_the_computation_load():
  # Qwen2.5's hub configs: a sliding window that no layer uses.
  c = ModelConfig.from_hf(_hf("qwen2", use_sliding_window=False, sliding_window=131072, max_window_layers=2))
  assert c.attention_bias and not c.has_sliding_layers
  assert not ModelConfig.from_hf(_hf("qwen2", use_sliding_window=True, sliding_window=16,
                                     max_window_layers=2)).has_sliding_layers
  assert ModelConfig.from_hf(_hf("qwen3", num_experts=0, mlp_only_layers=[])).qk_norm
  assert ModelConfig.from_hf(_hf("llama", hidden_act="gelu_pytorch_tanh")).hidden_act == "gelu_tanh"


@pytest.mark.parametrize("name,change,needle", [
    ("qwen3", dict(qk_norm=False), "qk_norm=False"),
    ("qwen2", dict(attention_bias=False), "attention_bias=False"),
    ("llama", dict(attn_logit_softcap=5.0), "attn_logit_softcap"),
    ("llama", dict(sliding_window=4, sliding_layers=(True, False)), "sliding_window, sliding_layers"),
    ("gemma2", dict(hidden_act="silu"), "hidden_act='silu'"),
])
def test_export_refuses_what_transformers_would_read_as_another_model(name, change, needle):
  family = families.get(name)
  c = ModelConfig(architecture=name, **SHAPE, **{**family.random_defaults(2, 8), **change})
  with pytest.raises(WeightsError, match=needle):
    c.to_hf()


@pytest.mark.parametrize("meta,needle", [
    ({"rope.dimension_count": 8}, "rope.dimension_count=8"),      # partial rotary embeddings
    ({"attention.value_length": 8}, "attention.value_length=8"),
    ({"expert_count": 8}, "expert_count=8"),
])
def test_gguf_metadata_that_changes_the_computation_is_refused(meta, needle, tmp_path):
  pytest.importorskip("gguf")
  path = write_gguf(hf_model("qwen2"), str(tmp_path / "m.gguf"), metadata_overrides=meta)
  with pytest.raises(WeightsError, match=f"{tmp_path}/m.gguf: metadata qwen2.{needle}"):
    gguf_io.open_gguf(path)


# ---- a family defined here, and nowhere else ---------------------------------------------------

COEF = 1e4   # the random model's MLP outputs are ~1e-3: a loss that moves the parameters visibly


class L2MLP(nn.Module):
  """The dense MLP plus an auxiliary loss COEF * (mean over real tokens of mean(y^2)), per layer."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, token_mask=None):
    y = gated_mlp(self, x)
    mask = jnp.ones(x.shape[:2], bool) if token_mask is None else token_mask
    per_token = jnp.mean(jnp.square(y.astype(jnp.float32)), axis=-1)
    value = COEF * jnp.sum(jnp.where(mask, per_token, 0)) / jnp.maximum(jnp.sum(mask), 1)
    return y, {"aux_losses": {"l2": value}, "router": {"tokens": jnp.sum(mask)}}


class Toy(Llama):
  """Llama with the L2MLP block: its own model_type, no GGUF, attention-only LoRA."""
  name = "toy_l2"
  model_types = ("rljax_toy_l2",)
  hf_class = "ToyL2ForCausalLM"
  gguf_architectures = ()
  lora_targets = ("q", "k", "v", "o")

  def feed_forward(self, config):
    return L2MLP


@pytest.fixture(scope="module")
def toy():
  with families.registered(Toy()):
    config = ModelConfig(architecture="toy_l2", **SHAPE, attention="xla")
    yield config, init_params(config, jax.random.key(0))


def test_a_new_family_loads_exports_and_runs(toy, tmp_path):
  config, params = toy
  out = rljax.save_pretrained(Policy(config, params), tmp_path / "toy")
  again = rljax.load_pretrained(out)
  assert again.config == config.replace(attention="auto")   # a runtime choice, not in config.json
  jax.tree.map(np.testing.assert_array_equal, again.params, jax.device_get(params))
  with pytest.raises(ConfigError, match=r"toy_l2 models take adapters on \['q', 'k', 'v', 'o'\] only"):
    config.replace(lora=LoraConfig(rank=2))
  # The block's auxiliary loss reaches ModelOutput, summed over layers, over real tokens only.
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 6)), jnp.int32)
  mask = jnp.asarray([[True] * 6, [False] * 2 + [True] * 4])
  pos = rljax.models.positions_from_mask(mask)
  result = apply_model(config, params, ids, pos, mask)
  assert set(result.aux_losses) == {"l2"} and float(result.aux_losses["l2"]) > 0
  np.testing.assert_array_equal(np.asarray(result.router["tokens"]), [10, 10])   # [L]: per-layer statistics
  pads_changed = apply_model(config, params, ids.at[1, :2].set(7), pos, mask)
  assert float(pads_changed.aux_losses["l2"]) == float(result.aux_losses["l2"])
  real_changed = apply_model(config, params, ids.at[1, 3].set(ids[1, 3] % 63 + 1), pos, mask)
  assert float(real_changed.aux_losses["l2"]) != float(result.aux_losses["l2"])
  # Dense families return none.
  dense = config.replace(architecture="llama")
  assert apply_model(dense, params, ids, pos, mask).aux_losses == {}


def test_the_learner_adds_the_auxiliary_loss(toy):
  """One update of the toy family and of Llama on the same parameters (the same policy: L2MLP's
  output is the MLP's): the loss differs by the auxiliary loss, the aux metric is the batch's token-weighted
  auxiliary loss however the batch is split (micro-batches, packed blocks), and the two updates
  differ by the auxiliary loss's gradient. The optimizer is made linear for that: Adam with
  b1 = b2 = 0 steps by lr * g / (|g| + eps), which with lr = eps = 1e3 is g to within |g| / 1e3.
  A dense model's update has no aux metric."""
  config, params = toy
  sp = SamplingParams(num_samples=G, max_new_tokens=T, temperature=1.0)
  optim = ml_collections.ConfigDict(dict(learning_rate=1e3, warmup_steps=0, min_lr_ratio=0.0, schedule="constant",
                                         max_grad_norm=None, b1=0.0, b2=0.0, eps=1e3, weight_decay=0.0))
  optimizer, _ = make_optimizer(optim, 10)
  state = TrainState.create(params, optimizer, 0)
  rollout = _rollout(2)
  seq = jnp.concatenate([rollout.prompt_ids, rollout.tokens], axis=1)
  seq_mask = jnp.concatenate([rollout.prompt_mask, rollout.context_mask], axis=1)
  aux = lambda p: apply_model(config, p, seq, rljax.models.positions_from_mask(seq_mask), seq_mask).aux_losses["l2"]
  want, aux_grad = jax.value_and_grad(aux)(params)

  def update(model, **kw):
    spec = StepSpec(model=model, sampling=sp, loss=LossConfig.from_preset("grpo", kl_coef=0.0), prompts=P, **kw)
    return jax.jit(make_update_fn(spec, optimizer))(state, rollout)

  toy_state, toy_metrics = update(config, micro_batches=2)
  dense_state, dense_metrics = update(config.replace(architecture="llama"), micro_batches=2)
  assert "aux_l2" not in dense_metrics
  np.testing.assert_allclose(toy_metrics["aux_l2"], want, rtol=1e-5)
  # The optimized loss is the policy loss (equal: the same policy) plus the auxiliary loss.
  np.testing.assert_allclose(toy_metrics["loss"], dense_metrics["loss"] + want, rtol=1e-5)   # fp32, two programs
  for got, dense, g in zip(jax.tree.leaves(toy_state.params), jax.tree.leaves(dense_state.params),
                           jax.tree.leaves(aux_grad)):
    ulps = 3e-7 * float(jnp.abs(dense).max())   # both parameters are rounded to float32
    np.testing.assert_allclose(np.asarray(got) - np.asarray(dense), -np.asarray(g), rtol=0,
                               atol=1e-3 * float(jnp.abs(g).max()) + ulps)
  assert float(jnp.abs(aux_grad["layers"]["mlp"]["down_kernel"]).max()) > 1e-4
  _, packed = update(config, pack_tokens=2 * (LP + T))
  np.testing.assert_allclose(packed["aux_l2"], want, rtol=1e-5)
