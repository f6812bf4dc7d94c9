"""The sampler-vs-learner log-prob gap: measured (not structurally 0) and corrected in bf16."""
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from rljax.config import base_config, loss_config, recompute_old_logprobs
from rljax.models.config import ModelConfig
from rljax.models.policy import init_params
from rljax.rl import LossConfig
from rljax.rollout import SamplingParams
from rljax.trainer.optim import make_optimizer
from rljax.trainer.state import TrainState
from rljax.trainer.step import StepSpec, make_generate_fn, make_update_fn


def _gap(dtype: str) -> dict:
  mc = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype=dtype)
  g = 4
  sp = SamplingParams(num_samples=g, max_new_tokens=24, temperature=1.0)
  spec = StepSpec(model=mc, sampling=sp, loss=LossConfig.from_preset("grpo", kl_coef=0.0), prompts=2, gap_rows=g)
  optim = ml_collections.ConfigDict(dict(learning_rate=1e-5, warmup_steps=0, min_lr_ratio=0.0, schedule="constant",
                                         max_grad_norm=1.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
  optimizer, _ = make_optimizer(optim, 10)
  params = init_params(mc, jax.random.key(0))
  params = jax.tree.map(lambda p: p * 8.0 if p.ndim == 2 else p, params)   # sharper logits: rounding shows
  state = TrainState.create(params, optimizer, 0)
  ids = jax.random.randint(jax.random.key(1), (2, 8), 1, 256)
  rollout = jax.jit(make_generate_fn(spec))(state.params, jax.random.key(2), ids, jnp.ones((2, 8), bool))
  rollout = rollout.with_rewards(jnp.arange(8, dtype=jnp.float32), jnp.zeros((8, 1)))
  _, metrics = jax.jit(make_update_fn(spec, optimizer))(state, rollout)
  return {k: float(v) for k, v in metrics.items()}


def test_gap_metric_is_measured_not_assumed():
  """fp32: the learner's recompute matches the sampler to ~1e-6; bf16: the gap shows (it is the
  learner really recomputing one group, so it is not 0 by construction)."""
  f32, bf16 = _gap("float32"), _gap("bfloat16")
  assert f32["sampler/logprob_gap_mean"] < 1e-5
  assert bf16["sampler/logprob_gap_mean"] > 10 * max(f32["sampler/logprob_gap_mean"], 1e-7)
  assert bf16["sampler/logprob_gap_frac_1pct"] > 0


def test_bf16_runs_recompute_lp_old_with_truncated_is_by_default():
  c = base_config()
  assert not recompute_old_logprobs(c) and loss_config(c).tis_cap is None        # fp32 fused: sampler's lp_old
  c.model.dtype = "bfloat16"
  assert recompute_old_logprobs(c) and loss_config(c).tis_cap == pytest.approx(2.0)
  c.rollout.proximal = "sampler"                                                  # the explicit opt-out
  assert not recompute_old_logprobs(c)
