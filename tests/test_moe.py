"""Qwen3-MoE against transformers: config.json both ways, the hub's per-expert weight layout in and
out, logits, greedy generation; and the router's own maths (top-k, replay, aux losses, statistics)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import hf_logits, hf_model_from_config, left_padded_prompts, max_diff_on_tokens, ragged_batch

import rljax
from rljax.errors import ConfigError, WeightsError
from rljax.models import LoraConfig, ModelConfig, apply_model, init_params, io as model_io, positions_from_mask
from rljax.models.config import MoeConfig
from rljax.models.moe import route
from rljax.rollout import SamplingParams, sample

TOL = 1e-4
VOCAB = 256
# Two tiny models: without norm_topk_prob and a dense first layer (decoder_sparse_step 2), and
# with it and a dense layer in the middle (mlp_only_layers).
VARIANTS = {
    "sparse_step": dict(num_hidden_layers=2, decoder_sparse_step=2, norm_topk_prob=False),
    "mlp_only": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
}


def hf_moe_config(**fields):
  import transformers
  base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
  return transformers.Qwen3MoeConfig(**{**base, **fields})


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """variant -> (transformers model, its save_pretrained directory, reference logits on the ragged batch)."""
  ids, mask = ragged_batch()
  out = {}
  for name, fields in VARIANTS.items():
    model = hf_model_from_config(hf_moe_config(**fields), seed=1)
    d = str(tmp_path_factory.mktemp(f"hf_{name}"))
    model.save_pretrained(d)
    out[name] = (model, d, hf_logits(model, ids, mask))
  return out


@pytest.fixture(scope="module")
def policies(hf_dirs):
  return {name: rljax.load_pretrained(d) for name, (_, d, _) in hf_dirs.items()}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_loads_the_hub_layout_and_matches_transformers(name, hf_dirs, policies):
  model, d, ref = hf_dirs[name]
  with open(os.path.join(d, "config.json")) as f:
    hf = json.load(f)
  assert hf["model_type"] == "qwen3_moe"
  from safetensors import safe_open
  keys = set(safe_open(os.path.join(d, "model.safetensors"), "np").keys())
  moe = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
  first = moe.index(True)
  assert f"model.layers.{first}.mlp.experts.7.down_proj.weight" in keys   # the hub's per-expert tensors
  policy = policies[name]
  c = policy.config
  assert c.architecture == "qwen3_moe" and c.qk_norm
  assert c.moe == MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=32,
                            norm_topk_prob=VARIANTS[name]["norm_topk_prob"],
                            sparse_step=VARIANTS[name].get("decoder_sparse_step", 1),
                            dense_layers=tuple(VARIANTS[name].get("mlp_only_layers", ())))
  assert list(c.moe_layers) == moe and not all(moe)   # a dense layer mixed in
  ids, mask = ragged_batch()
  logits = policy(ids, mask)
  assert max_diff_on_tokens(logits, ref, mask) <= TOL


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_writes_the_hub_layout_and_transformers_loads_it_unchanged(name, hf_dirs, policies, tmp_path):
  import transformers
  from safetensors import safe_open
  model, d, ref = hf_dirs[name]
  out = model_io.save_pretrained(policies[name], tmp_path / "out")
  ours = set(safe_open(os.path.join(out, "model.safetensors"), "np").keys())
  theirs = set(safe_open(os.path.join(d, "model.safetensors"), "np").keys())
  assert ours == theirs
  with open(os.path.join(out, "config.json")) as f:
    written = json.load(f)
  assert ModelConfig.from_hf(written) == policies[name].config.replace(attention="auto")
  again, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 attn_implementation="eager")
  assert not any(info.values()), info   # no missing, unexpected or mismatched tensors
  ids, mask = ragged_batch()
  assert max_diff_on_tokens(hf_logits(again.eval(), ids, mask), ref, mask) <= TOL
  # transformers' config class keeps every field we write, and reads them back to the same model.
  kept = transformers.AutoConfig.for_model(**written).to_dict()
  assert ModelConfig.from_hf(kept) == policies[name].config.replace(attention="auto")


def test_greedy_generation_equals_transformers(hf_dirs, policies):
  import torch
  model, _, _ = hf_dirs["mlp_only"]
  policy = policies["mlp_only"]
  ids, mask = left_padded_prompts([3, 7, 5], VOCAB, low=3)
  t_new = 8
  with torch.no_grad():
    ref = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                         do_sample=False, max_new_tokens=t_new, eos_token_id=None, pad_token_id=0)
  ref = ref[:, ids.shape[1]:].numpy()
  sp = SamplingParams(num_samples=1, max_new_tokens=t_new, greedy=True)
  out = jax.jit(sample, static_argnums=(0, 4))(policy.config, policy.params, jnp.asarray(ids), jnp.asarray(mask),
                                               sp, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), ref)


# ---- config and refusals ------------------------------------------------------------------------


def _hf(**fields):
  return hf_moe_config(num_hidden_layers=2, **fields).to_dict()


@pytest.mark.parametrize("fields,needles", [
    (dict(shared_expert_intermediate_size=64), ["shared_expert_intermediate_size=64", "no shared expert"]),
    (dict(num_experts=0), ["num_experts=0"]),
    (dict(attention_bias=True), ["attention_bias=True"]),
])
def test_what_rljax_does_not_compute_is_refused_by_name(fields, needles):
  hf = {**_hf(), **fields}
  hf.pop("num_local_experts", None) if "num_experts" in fields else None
  with pytest.raises(WeightsError) as info:
    ModelConfig.from_hf(hf, source="d/config.json")
  for needle in needles:
    assert needle in str(info.value), (needle, str(info.value))


def test_lora_on_experts_is_refused_by_name_and_attention_adapters_are_accepted():
  c = ModelConfig.from_hf(_hf())
  with pytest.raises(ConfigError, match=r"qwen3_moe models take adapters on \['q', 'k', 'v', 'o'\] only \(the "
                                        r"experts and the router take no adapter"):
    c.replace(lora=LoraConfig(rank=2, targets=("q", "gate")))
  assert c.replace(lora=LoraConfig(rank=2, targets=("q", "v"))).lora.targets == ("q", "v")


def test_moe_config_is_validated_by_field():
  with pytest.raises(ConfigError, match="model.moe.experts_per_token=9 exceeds model.moe.num_experts=8"):
    MoeConfig(num_experts=8, experts_per_token=9, intermediate_size=4)
  with pytest.raises(ConfigError, match="model.moe.aux_loss_coef=-1"):
    MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=4, aux_loss_coef=-1)
  with pytest.raises(ConfigError, match="model.moe.dispatch='ring'"):
    MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=4, dispatch="ring")
  c = ModelConfig.from_hf(_hf())
  with pytest.raises(ConfigError, match="is a mixture-of-experts family but model.moe is None"):
    c.replace(moe=None)
  with pytest.raises(ConfigError, match="is a dense family but model.moe is set"):
    c.replace(architecture="qwen3")
  with pytest.raises(ConfigError, match=r"dense_layers=\[5\] names layers past model.num_layers=2"):
    c.replace(moe=c.moe.replace(dense_layers=(5,)))


# ---- the router ---------------------------------------------------------------------------------


def test_route_top_k_norm_and_replay():
  logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25], [0.4, 0.3, 0.2, 0.1]]))
  ids, gates, probs = route(logits, 2, False)
  np.testing.assert_array_equal(ids, [[1, 3], [0, 1]])
  np.testing.assert_allclose(gates, [[0.5, 0.25], [0.4, 0.3]], rtol=1e-6)
  _, normed, _ = route(logits, 2, True)
  np.testing.assert_allclose(normed, [[2 / 3, 1 / 3], [4 / 7, 3 / 7]], rtol=1e-6)
  # Replayed experts (row 0) take the probabilities at those experts; a row not recorded (ids >= E) routes itself.
  replay = jnp.asarray([[2, 0], [4, 4]], jnp.uint8)
  ids, gates, _ = route(logits, 2, True, replay)
  np.testing.assert_array_equal(ids, [[2, 0], [0, 1]])
  np.testing.assert_allclose(gates, [[0.6, 0.4], [4 / 7, 3 / 7]], rtol=1e-6)
  grad = jax.grad(lambda lg: route(lg, 2, True, replay)[1][0, 0])(logits)
  assert float(jnp.abs(grad[0]).max()) > 0   # the router learns through replayed gates


@pytest.fixture(scope="module")
def tiny():
  c = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, attention="xla",
                  moe=MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(1,)))
  params = init_params(c, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 10 if x.ndim == 3 and x.shape[-1] == 4 else x, params)   # a decisive router
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 6)), jnp.int32)
  mask = jnp.asarray([[True] * 6, [False] * 2 + [True] * 4])
  return c, params, ids, mask


def test_aux_losses_and_statistics_over_real_tokens(tiny):
  c, params, ids, mask = tiny
  pos = positions_from_mask(mask)
  off = apply_model(c, params, ids, pos, mask)
  assert off.aux_losses == {}   # off by default (the RL default)
  assert set(off.router) == {"experts", "load", "entropy", "tokens"}
  assert off.router["experts"].shape == (2, 2, 6, 2)   # [L_moe, B, T, k]: two MoE layers of three
  np.testing.assert_array_equal(off.router["tokens"], [10, 10])
  np.testing.assert_array_equal(off.router["load"].sum(-1), [20, 20])   # k copies of each real token
  on = c.replace(moe=c.moe.replace(aux_loss_coef=0.5, z_loss_coef=0.25))
  out = apply_model(on, params, ids, pos, mask)
  np.testing.assert_allclose(out.logits, off.logits, rtol=0, atol=0)
  for name in ("load_balance", "router_z"):   # closed forms: test_load_balance_loss_matches_transformers
    assert float(out.aux_losses[name]) > 0
  # Pads do not count: changing a pad token leaves the losses unchanged; a real one changes them.
  same = apply_model(on, params, ids.at[1, 0].set(5), pos, mask)
  assert float(same.aux_losses["load_balance"]) == float(out.aux_losses["load_balance"])
  other = apply_model(on, params, ids.at[1, 4].set(ids[1, 4] % 63 + 1), pos, mask)
  assert float(other.aux_losses["router_z"]) != float(out.aux_losses["router_z"])


def test_load_balance_loss_matches_transformers_single_layer():
  """transformers' load_balancing_loss_func on one layer's router logits is E * sum_e f_e P_e
  (f_e: copies routed to e per token, P_e: mean probability): rljax's per-layer loss."""
  import torch
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

  from rljax.models.moe import router_stats
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(12, 8)).astype(np.float32)
  c = ModelConfig(architecture="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True,
                  moe=MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=4, aux_loss_coef=1.0))
  ids, _, probs = route(jnp.asarray(logits), 2, False)
  aux, stats = router_stats(c, jnp.asarray(logits), probs, ids, jnp.ones((12,), bool))
  ref = load_balancing_loss_func((torch.tensor(logits),), 8, 2)
  np.testing.assert_allclose(float(aux["load_balance"]), float(ref), rtol=1e-5)
  np.testing.assert_allclose(stats["entropy"], -np.sum(probs * np.log(probs)), rtol=1e-5)


def test_replaying_the_models_own_routes_changes_nothing_and_other_routes_do(tiny):
  c, params, ids, mask = tiny
  pos = positions_from_mask(mask)
  out = apply_model(c, params, ids, pos, mask)
  own = jnp.moveaxis(out.router["experts"], 0, 2).astype(jnp.uint8)   # [B, T, L_moe, k]
  again = apply_model(c, params, ids, pos, mask, routes=own)
  np.testing.assert_array_equal(again.logits, out.logits)
  flipped = (own + 1) % 4
  moved = apply_model(c, params, ids, pos, mask, routes=flipped)
  np.testing.assert_array_equal(jnp.moveaxis(moved.router["experts"], 0, 2), flipped)
  assert float(jnp.abs(moved.logits - out.logits).max()) > 1e-3
  unrecorded = jnp.full_like(own, 4)
  np.testing.assert_array_equal(apply_model(c, params, ids, pos, mask, routes=unrecorded).logits, out.logits)


def test_sharded_load_reads_each_devices_experts(hf_dirs, policies):
  """With a mesh, each device's block of the [E, D, F] kernels is read from its experts' tensors
  (experts split over fsdp): the same parameters as the whole load."""
  from rljax import sharding as shd
  _, d, _ = hf_dirs["mlp_only"]
  mesh = shd.make_mesh((2, 4, 1))
  sharded = rljax.load_pretrained(d, mesh=mesh, tokenizer=False)
  kernel = sharded.params["layers"]["moe"]["down_kernel"]
  assert kernel.sharding.spec[1] == "fsdp" and kernel.addressable_shards[0].data.shape[1] == 2   # 8 experts / 4
  for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(policies["mlp_only"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
