"""Expert parallelism: a tiny Qwen3-MoE on meshes whose fsdp axis (2 and 4 chips) splits the experts
gives the one-device logits and gradients (both dispatches), and samples the same greedy tokens
with the sampler's layout, which keeps the experts split."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sharding as shd
from rljax.models import moe as moe_lib
from rljax.models.config import ModelConfig, MoeConfig
from rljax.models.policy import apply_model, init_params, param_logical_axes, param_shardings
from rljax.models.transformer import positions_from_mask
from rljax.rollout import SamplingParams
from rljax.rollout.sampler import decode_params, sample

C = ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, attention="xla",
                moe=MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=16, dense_layers=(0,)))
IDS = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 6)), jnp.int32)
MASK = jnp.ones((8, 6), bool).at[1, :2].set(False)


def _loss(params, config):
  out = apply_model(config, params, IDS, positions_from_mask(MASK), MASK)
  return jnp.mean(jax.nn.log_softmax(out.logits) * MASK[..., None]), out.logits


@pytest.fixture(scope="module")
def one_device():
  params = init_params(C, jax.random.key(0))
  (_, logits), grads = jax.jit(jax.value_and_grad(lambda p: _loss(p, C), has_aux=True))(params)
  return params, logits, grads


@pytest.mark.parametrize("shape,dispatch", [((4, 2, 1), "gather"), ((2, 4, 1), "all_to_all"), ((1, 4, 2), "auto")])
def test_expert_parallel_learner_equals_one_device(shape, dispatch, one_device):
  params, ref_logits, ref_grads = one_device
  config = C.replace(moe=C.moe.replace(dispatch=dispatch))
  mesh = shd.make_mesh(shape)
  shardings = param_shardings(config, mesh)
  kernel = shardings["layers"]["moe"]["gate_kernel"].spec   # [L_moe, E, D, F]: E over fsdp, F over tensor
  assert kernel == jax.sharding.PartitionSpec(None, "fsdp", None, "tensor" if shape[2] > 1 else None)
  assert moe_lib.expert_parallel(config, mesh)
  assert moe_lib.dispatch_mode(config, shape[1]) == {"auto": "all_to_all", "gather": "gather",
                                                      "all_to_all": "all_to_all"}[dispatch]

  def step(p):
    with shd.activate(mesh):
      return jax.value_and_grad(lambda q: _loss(q, config), has_aux=True)(p)

  (_, logits), grads = jax.jit(step)(jax.device_put(params, shardings))
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_sampler_keeps_experts_split_and_decodes_like_one_device(one_device):
  params = one_device[0]
  mesh = shd.make_mesh((2, 4, 1))
  decode = shd.decode_param_shardings(param_logical_axes(C), params, mesh)
  assert decode["layers"]["moe"]["down_kernel"].spec[1] == "fsdp"   # E / 4 experts per chip while decoding
  sp = SamplingParams(num_samples=2, max_new_tokens=6, greedy=True)
  prompts, pmask = IDS[:4], MASK[:4]
  ref = jax.jit(sample, static_argnums=(0, 4))(C, params, prompts, pmask, sp, jax.random.key(0))

  def on_mesh(p, ids, m):
    with shd.activate(mesh):
      return sample(C, decode_params(C, p, mesh), ids, m, sp, jax.random.key(0), mesh=mesh)

  out = jax.jit(on_mesh)(jax.device_put(params, param_shardings(C, mesh)), prompts, pmask)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
