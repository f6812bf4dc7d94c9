"""LoRA (rljax/models/lora.py): the adapted model, its training in every rollout mode, the KL
reference without a copy, checkpoints of the adapters alone, exact resume, merged export."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.config_overrides import apply_overrides, load_config_file
from rljax.errors import ConfigError
from rljax.models import LoraConfig, ModelConfig, init_params, lora
from rljax.models.policy import apply_model
from rljax.models.transformer import positions_from_mask
from rljax.trainer.loop import Trainer

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def tiny(**lora_kw) -> ModelConfig:
  return ModelConfig(**TINY, lora=LoraConfig(rank=4, alpha=8.0, **lora_kw))


def random_adapters(config, seed=1, scale=0.05):
  """Adapters with non-zero B (fresh ones leave the model unchanged, which tests nothing)."""
  base, adapters = lora.split(init_params(config, jax.random.key(0)))
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))
  return base, jax.tree.map(lambda x: scale * jax.random.normal(next(keys), x.shape), adapters)


def batch(config, rows=3, length=9, seed=2):
  tokens = jax.random.randint(jax.random.key(seed), (rows, length), 0, config.vocab_size)
  mask = jnp.ones((rows, length), bool).at[0, :3].set(False)   # one left-padded row
  return tokens, mask, positions_from_mask(mask)


def test_fresh_adapters_leave_the_model_unchanged_and_the_base_is_the_model_without_them():
  c = tiny()
  base, adapters = lora.split(init_params(c, jax.random.key(0)))
  assert set(adapters["layers"]["attn"]) == {f"{n}_lora_{ab}" for n in "qkvo" for ab in "ab"}
  assert all(float(jnp.abs(b).max()) == 0.0 for k, b in adapters["layers"]["mlp"].items() if k.endswith("_b"))
  tokens, mask, pos = batch(c)
  plain = apply_model(c.replace(lora=None), base, tokens, pos, mask).logits
  adapted = apply_model(c, lora.join(base, adapters), tokens, pos, mask).logits
  off = apply_model(c, base, tokens, pos, mask).logits   # the KL reference: the tree without adapters
  np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(off), np.asarray(plain))


def test_merged_kernels_equal_the_adapted_model():
  """W + (alpha / r) A B folded into the kernels computes what the adapter path computes (fp32,
  one rounding of the fold: 1e-5 on logits of magnitude ~1)."""
  c = tiny(targets=("q", "v", "o", "down"))
  base, adapters = random_adapters(c)
  tokens, mask, pos = batch(c)
  adapted = apply_model(c, lora.join(base, adapters), tokens, pos, mask).logits
  base_only = apply_model(c, base, tokens, pos, mask).logits
  merged = apply_model(c.replace(lora=None), lora.merge(c, base, adapters), tokens, pos, mask).logits
  assert float(jnp.abs(adapted - base_only).max()) > 1e-2      # the adapters do change the model
  np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), atol=1e-5)


def test_sampler_equals_learner_logprobs_with_adapters_fp32():
  """The sampler's cached decode and the learner's teacher-forced forward run the same adapted
  model: their log-probs agree to float32 rounding (1e-5)."""
  from rljax.rl import LossConfig
  from rljax.rollout import SamplingParams, sample
  from rljax.trainer.step import StepSpec, sequence_logprobs
  c = tiny()
  base, adapters = random_adapters(c, scale=0.2)
  params = lora.join(base, adapters)
  prompt_ids, prompt_mask, _ = batch(c, rows=2, length=6)
  sp = SamplingParams(num_samples=3, max_new_tokens=10, temperature=1.0)
  out = sample(c, params, prompt_ids, prompt_mask, sp, jax.random.key(7))
  spec = StepSpec(model=c, sampling=sp, loss=LossConfig.from_preset("grpo"), prompts=2)
  lp, _ = sequence_logprobs(spec, params, out.prompt_ids, out.prompt_mask, out.tokens, out.mask)
  m = np.asarray(out.mask)
  assert m.sum() > 10
  np.testing.assert_allclose(np.asarray(lp)[m], np.asarray(out.logprobs)[m], atol=1e-5)
  lp_base, _ = sequence_logprobs(spec, base, out.prompt_ids, out.prompt_mask, out.tokens, out.mask)
  assert np.abs(np.asarray(lp_base)[m] - np.asarray(out.logprobs)[m]).max() > 1e-3   # not the base's


def test_dropout_acts_in_the_learner_forward_only():
  c = tiny(dropout=0.5)
  base, adapters = random_adapters(c, scale=0.2)
  params = lora.join(base, adapters)
  tokens, mask, pos = batch(c)
  plain = apply_model(c, params, tokens, pos, mask).logits
  dropped = apply_model(c, params, tokens, pos, mask, dropout_rng=jax.random.key(3)).logits
  again = apply_model(c, params, tokens, pos, mask, dropout_rng=jax.random.key(3)).logits
  no_dropout = apply_model(c.replace(lora=LoraConfig(rank=4, alpha=8.0)), params, tokens, pos, mask).logits
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(no_dropout))   # no key: no dropout
  np.testing.assert_array_equal(np.asarray(dropped), np.asarray(again))      # a key: a fixed mask
  assert float(jnp.abs(dropped - plain).max()) > 1e-3


@pytest.mark.parametrize("field, value, match", [
    ("rank", -1, "lora.rank"), ("targets", ["q", "embed"], "lora.targets"), ("dropout", 1.0, "lora.dropout"),
    ("alpha", 0.0, "lora.alpha")])
def test_bad_lora_config_is_refused(field, value, match):
  from rljax.config import base_config, validate
  c = base_config()
  c.model.lora.rank = 8
  c.model.lora[field] = value
  with pytest.raises(ConfigError, match=match):
    validate(c)


# ---- training ----------------------------------------------------------------------------------

def smoke(tmp_path, *overrides):
  cfg = load_config_file(os.path.join(CONFIGS, "smoke.py"))
  apply_overrides(cfg, [f"output.dir={str(tmp_path / 'run')!r}", "model.lora.rank=4", "model.lora.alpha=8.0",
                        "rl.kl_coef=0.05", "output.progress=False", "output.tensorboard=False", *overrides])
  return cfg


def tools_config(tmp_path):
  from models_testlib import tiny_retool_config
  c = tiny_retool_config(tmp_path / "run", max_new_tokens=32)
  apply_overrides(c, ["model.lora.rank=4", "rl.kl_coef=0.05", "optim.learning_rate=0.05"])
  return c


MODES = {
    "fused": [],
    "pipelined": ["rollout.mode='pipelined'"],
    "async": ["rollout.mode='async'"],
    "partial": ["rollout.mode='partial'", "train.prompts_per_step=4", "sampling.num_samples=4"],
}


@pytest.mark.parametrize("mode", list(MODES) + ["tools"])
def test_lora_trains_in_every_rollout_mode(tmp_path, mode):
  """Two steps in each rollout mode (and the multi-turn tool producer): only the adapters move,
  the frozen base is bitwise unchanged, the optimizer holds moments for the adapters alone, and
  the KL to the base (the reference, no copy) is 0 at the first update (fresh adapters) and
  positive once they have moved."""
  cfg = tools_config(tmp_path) if mode == "tools" else smoke(tmp_path, "train.steps=2", *MODES[mode])
  trainer = Trainer(cfg)
  try:
    base0 = jax.device_get(trainer.state.frozen)
    adapters0 = jax.device_get(trainer.state.params)
    metrics = [trainer.run_step() for _ in range(2)]
  finally:
    trainer.close()
  assert trainer.state.ref_params is None
  adapter_names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters0)[0]}
  assert adapter_names and all("_lora_" in n for n in adapter_names)
  moments = optax.tree_utils.tree_get_all_with_path(trainer.state.opt_state, "mu")   # AdamW's first moments
  assert len(moments) == 1 and jax.tree.structure(moments[0][1]) == jax.tree.structure(adapters0)
  for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(jax.device_get(trainer.state.frozen))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
           for a, b in zip(jax.tree.leaves(adapters0), jax.tree.leaves(jax.device_get(trainer.state.params)))]
  assert max(moved) > 0
  assert all(np.isfinite(m["loss"]) for m in metrics)
  if mode != "partial":   # partial trains groups as they finish; its first update may come later
    assert metrics[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
  assert metrics[-1]["kl_ref"] > 0
  if mode == "async":   # step 1 reports the first publish (base and adapters) and its own (adapters), step 2 its own
    size = lambda tree: 4 * 4 * sum(np.size(x) for x in jax.tree.leaves(tree))   # float32 on 4 generators
    assert [m["rollout/publish_bytes"] for m in metrics] == [size(base0) + 2 * size(adapters0), size(adapters0)]


def test_lora_resume_is_exact_and_checkpoints_hold_only_the_adapters(tmp_path):
  """4 steps straight == 2 steps, stop, resume, 2 more (bitwise on CPU); the checkpoint has no
  base weights; it records the base's checksum, so other weights put at the same model.path are
  refused on resume."""
  from rljax.models.io import save_pretrained
  from rljax.trainer.loop import load_policy

  def write_base(seed):
    cfg = smoke(tmp_path, f"model.random.seed={seed}", "model.lora.rank=0")
    save_pretrained(load_policy(cfg.model, cfg.tokenizer), tmp_path / "base", dtype="float32")

  write_base(0)
  cfg = lambda run: smoke(tmp_path / run, "train.steps=4", f"model.path={str(tmp_path / 'base')!r}")
  straight = Trainer(cfg("straight"))
  want = [straight.run_step() for _ in range(4)]
  want_params = jax.device_get(straight.state.params)
  straight.close()

  first = Trainer(cfg("split"))
  got = [first.run_step() for _ in range(2)]
  first.save()
  first.ckpt.wait()
  saved = first.ckpt._saved_leaves(2)
  first.close()
  assert saved and all(k.startswith(("params.", "opt_state.", "step", "rng")) for k in saved), sorted(saved)[:5]
  assert all("_lora_" in k for k in saved if k.startswith("params."))
  resumed = Trainer(cfg("split"))
  assert resumed.start_step == 2
  try:
    got += [resumed.run_step() for _ in range(2)]
  finally:
    resumed.close()
  for step, (a, b) in enumerate(zip(got, want)):
    for key in ("reward/mean", "loss", "grad_norm", "kl_ref", "sampler/tokens"):
      assert a[key] == b[key], (step, key)
  for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.params)), jax.tree.leaves(want_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  write_base(1)
  with pytest.raises(ConfigError, match="another base model"):
    Trainer(cfg("split"))


def test_lora_run_exports_merged_and_peft_and_rljax_export_agrees(tmp_path):
  """A LoRA run ends with `<dir>/hf` (adapters merged into the base: plain transformers loads it)
  and `<dir>/peft` (adapters alone: peft loads them onto the base); both give rljax's logits of
  the adapted model (fp32, 1e-4). `rljax export` of the checkpoint writes the same tensors (to
  float32 rounding)."""
  import torch
  import transformers
  from peft import PeftModel
  from safetensors.numpy import load_file

  from rljax.models.io import save_pretrained
  from rljax.models.policy import Policy
  from rljax.trainer.export import export_checkpoint
  cfg = smoke(tmp_path, "train.steps=2", "output.export_hf=True", "output.export_dtype='float32'",
              "optim.learning_rate=0.05")
  trainer = Trainer(cfg)
  summary = trainer.run()
  config = trainer.model_config
  base_dir = tmp_path / "base"
  save_pretrained(Policy(config.replace(lora=None), jax.device_get(trainer.state.frozen)), base_dir, dtype="float32")
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
  want = apply_model(config, trainer.state.model_params(), jnp.asarray(tokens), positions_from_mask(
      jnp.ones(tokens.shape, bool))).logits
  base_logits = apply_model(config, trainer.state.frozen, jnp.asarray(tokens), positions_from_mask(
      jnp.ones(tokens.shape, bool))).logits
  assert float(jnp.abs(want - base_logits).max()) > 1e-3   # the adapters were trained
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    merged = load(summary["hf_dir"])(torch.tensor(tokens)).logits.numpy()
    peft_model = PeftModel.from_pretrained(load(base_dir), os.path.join(cfg.output.dir, "peft")).eval()
    via_peft = peft_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(merged, np.asarray(want), atol=1e-4)
  np.testing.assert_allclose(via_peft, np.asarray(want), atol=1e-4)
  ckpt = summary["checkpoint_dir"]
  merged_again = export_checkpoint(ckpt, tmp_path / "merged", dtype="float32")
  peft_again = export_checkpoint(ckpt, tmp_path / "peft", fmt="peft")
  for ours, theirs, name in [(merged_again, summary["hf_dir"], "model.safetensors"),
                             (peft_again, os.path.join(cfg.output.dir, "peft"), "adapter_model.safetensors")]:
    a, b = load_file(os.path.join(ours, name)), load_file(os.path.join(theirs, name))
    assert a.keys() == b.keys()
    for k in a:   # the A B product of a sharded and a one-device run may round differently: 2 ulp
      np.testing.assert_allclose(a[k], b[k], rtol=2.4e-7, atol=1e-8)


def test_adapters_are_sharded_like_the_weights_they_adapt_and_a_mesh_trains_like_one_device(tmp_path):
  """On mesh (1, 2, 4) an adapter takes its kernel's layout on the axes they share (A's input
  axis, B's output axes) and its rank axis goes over fsdp where fsdp is still free (ZeRO-3 for the
  adapters and their moments); the base keeps the full-FT layout. Two
  steps there equal two steps on the data-parallel mesh (8, 1, 1) to float32 reduction order
  (the bound of tests/test_trainer.py::test_sharded_step_matches_single_device)."""
  from jax.sharding import PartitionSpec as P
  lr, eps, rho = 0.1, 1e-3, 2e-5
  opt = (f"optim.learning_rate={lr}", f"optim.eps={eps}", "rl.kl_coef=0.0")
  runs = {}
  for shape in ("(8, 1, 1)", "(1, 2, 4)"):
    trainer = Trainer(smoke(tmp_path / shape.replace(" ", ""), f"mesh.shape={shape}", *opt))
    try:
      metrics = [trainer.run_step() for _ in range(2)]
      runs[shape] = (metrics, jax.device_get(trainer.state.params), trainer.state)
    finally:
      trainer.close()
  state = runs["(1, 2, 4)"][2]
  attn, mlp = state.params["layers"]["attn"], state.params["layers"]["mlp"]
  assert attn["q_lora_a"].sharding.spec == P(None, "fsdp", None)
  assert attn["q_lora_b"].sharding.spec == P(None, "fsdp", "tensor", None)
  assert attn["o_lora_a"].sharding.spec == P(None, "tensor", None, "fsdp")
  assert mlp["down_lora_a"].sharding.spec == P(None, "tensor", "fsdp")
  assert mlp["up_lora_b"].sharding.spec == P(None, "fsdp", "tensor")
  assert state.frozen["layers"]["attn"]["q_kernel"].sharding.spec == P(None, "fsdp", "tensor", None)
  (one, p_one, _), (other, p_other, _) = runs["(8, 1, 1)"], runs["(1, 2, 4)"]
  for a, b in zip(one, other):
    assert a["sampler/tokens"] == b["sampler/tokens"] and a["reward/mean"] == b["reward/mean"]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rho)
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)]).astype(np.float64) for p in (p_one, p_other))
  bound = 3 * (lr / eps) * rho * max(m["grad_norm"] for m in one)
  assert np.linalg.norm(a - b) <= bound, (np.linalg.norm(a - b), bound)
