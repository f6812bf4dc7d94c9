"""LossConfig: presets set what their papers say, and bad input fails with the field named."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from rljax.errors import ConfigError
from rljax.rl import PRESETS, LossConfig, compute_advantages, make_denominators

ALL_PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "lite_ppo", "rloo", "reinforce_pp"]


def test_every_named_preset_exists_and_validates():
  assert sorted(PRESETS) == sorted(ALL_PRESETS)
  for name in ALL_PRESETS:
    cfg = LossConfig.from_preset(name)
    cfg.validate(group_size=8)
    hash(cfg)  # static argument of jit


def test_preset_settings():
  grpo = LossConfig.from_preset("grpo")
  assert (grpo.mean_scope, grpo.std_scope, grpo.clip_low, grpo.clip_high, grpo.agg) == (
      "group", "group", 0.2, 0.2, "seq-mean-token-mean")
  assert (grpo.kl_coef, grpo.kl_estimator, grpo.kl_in_reward) == (0.04, "k3", False)
  dr = LossConfig.from_preset("dr_grpo")
  assert (dr.std_scope, dr.agg, dr.kl_coef) == ("none", "seq-mean-token-sum-norm", 0.0)
  dapo = LossConfig.from_preset("dapo")
  assert (dapo.clip_low, dapo.clip_high, dapo.agg, dapo.overlong_filter, dapo.kl_coef) == (
      0.2, 0.28, "token-mean", True, 0.0)
  gspo = LossConfig.from_preset("gspo")
  assert (gspo.ratio_level, gspo.clip_low, gspo.clip_high) == ("sequence", 3e-4, 4e-4)
  cispo = LossConfig.from_preset("cispo")
  assert (cispo.policy_loss, cispo.cispo_two_sided, cispo.agg) == ("cispo", False, "token-mean")
  lite = LossConfig.from_preset("lite_ppo")
  assert (lite.mean_scope, lite.std_scope, lite.agg) == ("group", "batch", "token-mean")
  rloo = LossConfig.from_preset("rloo")
  assert (rloo.mean_scope, rloo.std_scope, rloo.policy_loss) == ("rloo", "none", "reinforce")
  rpp = LossConfig.from_preset("reinforce_pp")
  assert (rpp.mean_scope, rpp.std_scope, rpp.batch_whiten, rpp.kl_estimator) == (
      "group", "none", True, "k2")


def test_preset_overrides_and_jit_static():
  cfg = LossConfig.from_preset("grpo", clip_high=0.28, kl_coef=0.0)
  assert cfg.clip_high == 0.28 and not cfg.needs_reference
  f = jax.jit(lambda r, c: compute_advantages(r, c)[0], static_argnums=1)
  out = f(jnp.array([[1.0, 0.0]]), cfg)
  assert out.shape == (1, 2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.clip_high = 0.3


@pytest.mark.parametrize("call, field", [
    (lambda: LossConfig.from_preset("grpoo"), "grpoo"),
    (lambda: LossConfig.from_preset("grpo", clip_hihg=0.3), "clip_hihg"),
    (lambda: LossConfig(agg="token_mean"), "agg"),
    (lambda: LossConfig(mean_scope="prompt"), "mean_scope"),
    (lambda: LossConfig(std_scope="global"), "std_scope"),
    (lambda: LossConfig(policy_loss="ppo2"), "policy_loss"),
    (lambda: LossConfig(kl_estimator="k4"), "kl_estimator"),
    (lambda: LossConfig(clip_high=-0.1), "clip_high"),
    (lambda: LossConfig.from_preset("dapo", clip_high=-0.01), "eps_high"),
    (lambda: LossConfig(clip_low=1.5), "clip_low"),
    (lambda: LossConfig(dual_clip=0.5), "dual_clip"),
    (lambda: LossConfig(policy_loss="cispo", dual_clip=3.0), "dual_clip"),
    (lambda: LossConfig(cispo_two_sided=True), "cispo_two_sided"),
    (lambda: LossConfig(policy_loss="reinforce", ratio_level="sequence"), "ratio_level"),
    (lambda: LossConfig(agg_norm=1024.0), "agg_norm"),
    (lambda: LossConfig(kl_coef=-1.0), "kl_coef"),
    (lambda: LossConfig(adv_eps="1e-6"), "adv_eps"),
    (lambda: LossConfig(batch_whiten=1), "batch_whiten"),
    (lambda: LossConfig(tis_cap=0.0), "tis_cap"),
    (lambda: LossConfig().replace(clip=0.2), "clip"),
])
def test_bad_config_names_the_field(call, field):
  with pytest.raises(ConfigError, match=field):
    call()


def test_group_of_one():
  with pytest.raises(ConfigError, match="group_size"):
    LossConfig.from_preset("grpo").validate(group_size=1)
  with pytest.raises(ConfigError, match="std_scope"):
    compute_advantages(jnp.ones((4, 1)), LossConfig.from_preset("grpo"))
  with pytest.raises(ConfigError, match="mean_scope"):
    LossConfig.from_preset("rloo").validate(group_size=1)
  with pytest.raises(ConfigError, match="group_size"):
    make_denominators(jnp.ones((6, 3)), 4, LossConfig())
  # Batch scopes are fine with G = 1.
  cfg = LossConfig(mean_scope="batch", std_scope="batch")
  adv, _ = compute_advantages(jnp.array([[1.0], [0.0], [2.0]]), cfg)
  assert adv.shape == (3, 1)
