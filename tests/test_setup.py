"""The Trainer and `rljax plan` share one setup (rljax/trainer/setup.py): for the same config they
build the same model config, StepSpec and state shardings, and the plan lowers exactly the
programs the trainer's runners call (compared as lowered StableHLO text, on 8 CPU devices)."""
import hashlib
import os

import jax
import numpy as np
import pytest

from rljax.config import apply_overrides, load_config_file
from rljax.errors import ConfigError
from rljax.plan.programs import build_inputs, build_run, program_of
from rljax.trainer import setup as setup_lib
from rljax.trainer.loop import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py")


def _trainer_and_plan(tmp_path, *overrides):
  cfg = load_config_file(SMOKE)
  apply_overrides(cfg, ["mesh.shape=(1,-1,1)", "rewards.num_workers=1", f"output.dir={str(tmp_path)!r}",
                        *overrides])
  trainer = Trainer(cfg)
  run = build_run(cfg)
  return trainer, run, build_inputs(run, trainer.mesh)


def _fingerprint(lowered) -> str:
  return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _same_setup(trainer, run, inputs):
  # The random model's context, the tokenizer's stop ids, the loss, the optimizer's schedule length.
  assert run.model == trainer.model_config and run.spec == trainer.spec
  assert run.spec.eos_ids == tuple(sorted(set(trainer.tokenizer.stop_ids))) and run.spec.eos_ids
  assert run.setup.total_updates == trainer.total_updates
  assert jax.tree.structure(inputs.state_sh) == jax.tree.structure(trainer.state_shardings)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a == b, inputs.state_sh, trainer.state_shardings)))
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)
  assert shapes(inputs.state) == shapes(trainer.state)


def test_plan_lowers_the_decoupled_modes_programs(tmp_path):
  # LoRA in bf16 with a KL term: the frozen base, the adapters, the reference and the recomputed lp_old.
  trainer, run, inputs = _trainer_and_plan(tmp_path, "rollout.mode='pipelined'", "model.lora.rank=4",
                                           "model.dtype='bfloat16'", "rl.kl_coef=0.05")
  try:
    _same_setup(trainer, run, inputs)
    assert trainer.state.frozen is not None and run.spec.recompute_old_logprobs
    # The sampler and the update the pipelined runner calls, on the trainer's own state; the key
    # and the prompts are the caller's inputs, the same abstract ones on both sides.
    generate, args = program_of("sampler", run, trainer.mesh, inputs)
    ours = trainer.runner.producer._generate.lower(trainer.state.model_params(), *args[1:])
    assert _fingerprint(ours) == _fingerprint(generate.lower(*args))
    update, args = program_of("learner", run, trainer.mesh, inputs)
    assert _fingerprint(trainer.runner.update.lower(trainer.state, inputs.rollout)) == _fingerprint(update.lower(*args))
  finally:
    trainer.close()


def test_plan_lowers_the_fused_step(tmp_path):
  trainer, run, inputs = _trainer_and_plan(tmp_path, "rollout.mode='fused'")
  try:
    _same_setup(trainer, run, inputs)
    sharding = inputs.prompt_ids.sharding
    ids = jax.device_put(np.zeros(inputs.prompt_ids.shape, np.int32), sharding)
    mask = jax.device_put(np.ones(inputs.prompt_mask.shape, bool), sharding)
    ours = trainer.runner.train_step.lower(trainer.state, ids, mask)
    # With the trainer's reward callback in place of the plan's stand-in, the programs are the same.
    step, args = program_of("fused", run, trainer.mesh, inputs, reward_fn=trainer.scorer.reward_fn)
    assert _fingerprint(ours) == _fingerprint(step.lower(*args))
  finally:
    trainer.close()


def test_plan_reads_the_model_config_without_weights(tmp_path):
  # A directory with only config.json: no tokenizer, so the stop ids are the config's EOS (and a note says so).
  (tmp_path / "config.json").write_text(
      '{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320, "hidden_size": 48, '
      '"intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
      '"max_position_embeddings": 256, "eos_token_id": 7, "tie_word_embeddings": true}')
  cfg = load_config_file(SMOKE)
  apply_overrides(cfg, [f"model.path={str(tmp_path)!r}", "tokenizer=''", "model.dtype='bfloat16'",
                        "model.lora.rank=2"])
  run = build_run(cfg)
  assert run.model.max_position_embeddings == 256 and run.model.dtype == "bfloat16"
  assert run.model.param_dtype == "bfloat16" and run.model.lora.rank == 2   # the LoRA base in model.dtype
  assert run.spec.eos_ids == (7,) and any("no tokenizer" in n for n in run.notes)
  with pytest.raises(ConfigError, match="exceeds the context"):
    apply_overrides(cfg, ["sampling.max_new_tokens=250"])
    build_run(cfg)
  assert setup_lib.sampling_params(cfg, [3, 1]).stop_token_ids == (1, 3)
