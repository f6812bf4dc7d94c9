"""What a mixture of experts costs: FLOPs count the active experts only (checked against the TPU
compiler's cost analysis, where `ragged_dot` is a native grouped matmul), parameter counts against
transformers, and `rljax plan` on a deviceless TPU topology (expert parameters per chip)."""
import jax
import jax.numpy as jnp
import pytest

from rljax import flops
from rljax.models.config import ModelConfig, MoeConfig
from rljax.models.families import get as family
from rljax.models.policy import apply_model, init_params
from rljax.plan.topology import libtpu_available, parse_topology


def moe(**kw):
  base = dict(architecture="qwen3_moe", vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=1,
              num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=256,
              tie_word_embeddings=True, attention="xla",
              moe=MoeConfig(num_experts=16, experts_per_token=2, intermediate_size=256))
  return ModelConfig(**{**base, **kw})


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not importable (pip install 'rljax[tpu]')")
@pytest.mark.parametrize("batch,length", [(2, 64), (4, 128)])
def test_moe_forward_flops_count_active_experts_and_match_xla_cost_analysis(batch, length):
  """XLA:CPU lowers ragged_dot to a masked loop over every expert (it would count all E), so the
  forward is compiled for a deviceless TPU chip, whose compiler counts the grouped matmul's real work."""
  from rljax.plan.topology import tpu_devices
  config = moe()
  device = tpu_devices(parse_topology("v5p:2x2x1"))[0]
  on = jax.sharding.SingleDeviceSharding(device)
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)
  params = jax.tree.map(abstract, jax.eval_shape(lambda: init_params(config, jax.random.key(0))))
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=on)
  cost = jax.jit(lambda p, t, pos: apply_model(config, p, t, pos).logits).lower(params, tokens, tokens).compile()
  cost = cost.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  ours = flops.forward_flops(config, batch * length, context=length)
  assert ours == pytest.approx(cost["flops"], rel=0.08)
  assert ours < cost["flops"]
  # Counting every expert (num_params' view) would be far off: E / k = 8 times the expert work.
  every = flops.forward_flops(config.replace(moe=config.moe.replace(experts_per_token=16)), batch * length, length)
  assert every > 2.5 * cost["flops"]


def test_parameter_counts_match_transformers_and_active_counts_k_experts():
  import transformers
  from models_testlib import hf_model_from_config
  from test_moe import hf_moe_config
  hf = hf_model_from_config(hf_moe_config(num_hidden_layers=3, mlp_only_layers=[1]), seed=0)
  c = ModelConfig.from_hf(hf.config.to_dict())
  assert c.num_params == sum(p.numel() for p in hf.parameters())
  assert isinstance(hf, transformers.Qwen3MoeForCausalLM)
  f = family("qwen3_moe")
  d, e, k, w = c.hidden_size, c.moe.num_experts, c.moe.experts_per_token, c.moe.intermediate_size
  assert c.num_params - f.active_params(c) == 2 * 3 * (e - k) * d * w   # 2 MoE layers, E - k idle experts


def test_plan_reports_the_experts_share_of_parameters_and_optimizer_state_per_chip():
  import contextlib
  import io
  import json

  from test_plan import TINY

  from rljax.plan import main
  from rljax.plan.report import render_text
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = main(TINY + ["--config.model.random.architecture=qwen3_moe", "--topology", "cpu:8", "--program",
                          "learner", "--json"])
  plan = json.loads(out.getvalue())
  assert status in (0, 3), out.getvalue()[-2000:]
  moe = plan["model"]["moe"]
  assert (moe["num_experts"], moe["experts_per_token"], moe["moe_layers"], moe["routing_replay"]) == (8, 2, 2, False)
  assert moe["active_params"] < plan["model"]["params"]
  learner = plan["programs"]["learner"]
  # Random qwen3_moe: 8 experts of width 64 on hidden 48, 2 layers; fsdp 8 splits them by expert:
  # each chip holds one whole expert per layer (gate, up, down), float32.
  experts = 2 * 3 * 48 * 64 * 4
  assert learner["expert_params_bytes"] == experts < learner["params_bytes"]
  assert learner["expert_opt_state_bytes"] == 2 * experts   # AdamW's two moments
  text = render_text(plan)
  assert "of which experts" in text and "2 of 8 experts per token" in text
  # The sampler keeps the routed experts split over fsdp (expert parallel); its layout says so.
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    main(TINY + ["--config.model.random.architecture=qwen3_moe", "--topology", "cpu:8", "--program", "sampler",
                 "--json"])
  decode = json.loads(out.getvalue())["decode"]
  assert decode["kind"] == "replicated" and "whole model except the routed experts" in decode["description"]
  assert "routed experts split over 8 chips" in decode["description"]
