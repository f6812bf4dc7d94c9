"""The objectives end to end in the Trainer on tiny random models: the SFT recipe learns, resumes exactly
and exports; rft keeps a fraction of its rows; distillation loads its teacher onto the mesh, keeps it out of
checkpoints and resumes exactly."""
import json
import os

import jax
import numpy as np
import pytest

import rljax
from rljax.config_overrides import apply_overrides, load_config_file
from rljax.models.io import save_pretrained
from rljax.models.policy import Policy
from rljax.trainer.loop import Trainer
from rljax.trainer.setup import load_policy

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")
TINY = ("model.path='random'", "tokenizer='smollm2-135m-instruct'", "model.dtype='float32'", "model.remat=False",
        "model.random.hidden_size=32", "model.random.intermediate_size=64", "model.random.head_dim=8")


def _config(name, out, *overrides):
  cfg = load_config_file(os.path.join(CONFIGS, name))
  apply_overrides(cfg, [f"output.dir={str(out)!r}", *overrides])
  return cfg


def _metrics(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _straight_and_resumed(make, steps, split):
  """(metrics, trainer) of `steps` steps straight, and of `split` steps, a checkpoint, a new Trainer
  resuming to `steps`."""
  straight = Trainer(make("straight"))
  want = _metrics(straight.run()["metrics_file"])
  first = Trainer(make("split"))
  got = [first.run_step() for _ in range(split)]
  first.save()
  first.ckpt.wait()
  first.close()
  resumed = Trainer(make("split"))
  assert resumed.start_step == split
  got += _metrics(resumed.run()["metrics_file"])
  assert len(got) == len(want) == steps
  for step, (a, b) in enumerate(zip(got, want)):
    for key in ("loss", "grad_norm", "sampler/tokens"):
      assert a[key] == b[key], (step, key)
  for a, b in zip(_leaves(resumed.state.params), _leaves(straight.state.params)):
    np.testing.assert_array_equal(a, b)
  return want, straight, resumed


def test_sft_recipe_on_a_tiny_model_learns_resumes_exactly_and_exports(tmp_path):
  """configs/sft_arithmetic.py (chat-formatted arithmetic prompts, "7 * 8 = 56" targets) on a tiny random
  model: the cross-entropy falls, 2 steps + resume + 2 equals 4 straight (bitwise), and the export is the
  trained model."""
  make = lambda name: _config("sft_arithmetic.py", tmp_path / name, *TINY, "train.steps=4", "optim.learning_rate=3e-2",
                              "optim.warmup_steps=0", "eval.before_and_after=False", "checkpoint.every=0",
                              "output.export_dtype='float32'", "output.tensorboard=False")
  want, straight, _ = _straight_and_resumed(make, steps=4, split=2)
  losses = [m["nll"] for m in want]
  assert losses[-1] < losses[0] - 1.0, losses
  assert all(m["num_tokens"] >= 8 * 6 for m in want)   # each target: "a op b = c" and <|im_end|>
  exported = rljax.load_pretrained(str(tmp_path / "straight" / "hf"))
  for a, b in zip(_leaves(exported.params), _leaves(straight.state.params)):
    np.testing.assert_array_equal(a, b)


def test_rft_keeps_only_rows_reaching_min_reward(tmp_path):
  """The smoke recipe's vowel reward is continuous in [0, 1]: at min_reward 0.4 a step keeps some rows and
  rejects others, and trains on the kept rows' tokens only."""
  cfg = _config("smoke.py", tmp_path / "rft", "train.objective='rft'", "rft.min_reward=0.4", "train.steps=2")
  trainer = Trainer(cfg)
  try:
    for _ in range(2):
      m = trainer.run_step()
      assert 0.0 < m["rft/kept_fraction"] < 1.0, m["rft/kept_fraction"]
      assert m["num_tokens"] == m["rft/kept_tokens"] < m["sampler/tokens"]
      assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
  finally:
    trainer.close()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A tiny random model with the smoke recipe's sizes and tokenizer but another seed, exported (once)."""
  out = tmp_path_factory.mktemp("teacher")
  cfg = _config("smoke.py", out / "unused", "model.random.seed=7")
  policy = load_policy(cfg.model, cfg.tokenizer)
  return str(save_pretrained(Policy(policy.config, policy.params, tokenizer=policy.tokenizer), out / "hf"))


def test_distill_from_a_teacher_dir_resumes_exactly_without_saving_the_teacher(tmp_path, teacher_dir):
  """On-policy distillation in the fused step: the teacher is loaded from an HF directory onto the mesh,
  sharded like the student; the reverse KL is reported; the teacher is not in the checkpoint (reloaded on
  resume) and 2 steps + resume + 1 equals 3 straight."""
  make = lambda name: _config("smoke.py", tmp_path / name, "train.objective='distill'",
                              f"distill.teacher={teacher_dir!r}", "train.steps=3", "sampling.num_samples=2",
                              "output.tensorboard=False")
  want, straight, resumed = _straight_and_resumed(make, steps=3, split=2)
  assert all(m["distill/reverse_kl"] > 0 for m in want)
  teacher = rljax.load_pretrained(teacher_dir)
  for a, b in zip(_leaves(resumed.state.teacher), _leaves(teacher.params)):
    np.testing.assert_array_equal(a, b)
  shardings = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, straight.state.teacher))
  assert all(s.mesh.size == 8 for s in shardings)
  saved = os.path.join(straight.ckpt.directory, "3")
  assert not any("teacher" in name for _, dirs, files in os.walk(saved) for name in dirs + files)


def test_plan_reads_the_teacher_config_and_counts_it_in_the_state(tmp_path, teacher_dir):
  """`rljax plan` builds a distillation run as the trainer does: the teacher's config from its directory (no
  weights read), the teacher in the abstract state, sharded on the mesh."""
  from rljax.plan.programs import build_run
  from rljax.trainer.setup import abstract_state
  cfg = _config("smoke.py", tmp_path / "plan", "train.objective='distill'", f"distill.teacher={teacher_dir!r}")
  run = build_run(cfg)
  teacher = rljax.load_pretrained(teacher_dir)
  assert run.setup.spec.teacher.vocab_size == teacher.config.vocab_size
  assert run.setup.spec.teacher.num_layers == teacher.config.num_layers
  mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "tensor"))
  state, shardings = abstract_state(run.setup, mesh)
  shapes = [x.shape for x in jax.tree.leaves(state.teacher)]
  assert shapes == [np.shape(x) for x in jax.tree.leaves(teacher.params)]
  assert jax.tree.structure(shardings.teacher) == jax.tree.structure(state.teacher)
