"""The trainer end to end on a tiny random model: learning, faults, meshes, exact resume, recipes."""
import json
import os
import textwrap

import jax
import numpy as np
import pytest

from rljax.config_overrides import apply_overrides, load_config_file
from rljax.trainer.loop import DataExhausted, Trainer, TrainingStopped
from rljax.trainer.optim import skip_counts

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")


def smoke(tmp_path, *overrides):
  cfg = load_config_file(os.path.join(CONFIGS, "smoke.py"))
  apply_overrides(cfg, [f"output.dir={str(tmp_path / 'run')!r}", *overrides])
  return cfg


def read_metrics(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_smoke_recipe_learns(tmp_path):
  summary = Trainer(smoke(tmp_path)).run()
  rewards = [m["reward/mean"] for m in read_metrics(summary["metrics_file"]) if "reward/mean" in m]
  assert len(rewards) == 20
  # The dense vowel reward starts near 0.37; training must lift it well above the start.
  assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
  assert os.path.isdir(summary["checkpoint_dir"])


@pytest.fixture
def slow_verifier_module(tmp_path, monkeypatch):
  mod = tmp_path / "mods"
  mod.mkdir()
  (mod / "slow_verifier.py").write_text(textwrap.dedent("""
      import time
      def forever(completion, example):
        time.sleep(3600)
        return 1.0
  """))
  monkeypatch.setenv("PYTHONPATH", str(mod) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.syspath_prepend(str(mod))
  return "slow_verifier:forever"


def test_verifier_that_always_times_out_gives_fallback_and_counts(tmp_path, slow_verifier_module):
  # 2 prompts x 4 samples: every item waits out its timeout on the one worker (64 items took 45 s).
  cfg = smoke(tmp_path, "train.steps=2", "train.prompts_per_step=2", "sampling.num_samples=4",
              "rewards.timeout_s=0.3", "rewards.fallback=-1.0")
  cfg.rewards.components = [dict(name="slow", verifier=slow_verifier_module, weight=1.0)]
  summary = Trainer(cfg).run()
  metrics = read_metrics(summary["metrics_file"])
  assert len(metrics) == 2
  for m in metrics:
    assert m["reward/mean"] == pytest.approx(-1.0)       # every item got the fallback
    assert m["verifier/timeouts"] > 0
    assert m["frac_reward_zero_std"] == 1.0             # no signal, so no update direction
    assert m["grad_norm"] == 0.0


def test_non_finite_gradients_are_skipped_then_the_run_stops(tmp_path):
  cfg = smoke(tmp_path, "train.steps=6", "optim.max_consecutive_skips=2", "checkpoint.every=1",
              "checkpoint.async_save=False")
  trainer = Trainer(cfg)
  trainer.run_step()
  trainer.save()
  good = jax.device_get(trainer.state.params)
  # Poison one weight: every later gradient is NaN, so every update must be skipped.
  poisoned = jax.tree.map(lambda x: x, trainer.state.params)
  poisoned["final_norm"]["scale"] = poisoned["final_norm"]["scale"].at[0].set(np.nan)
  trainer.state = trainer.state.replace(params=poisoned)
  trainer.start_step = 1
  with pytest.raises(TrainingStopped, match="non-finite"):
    trainer.run()
  assert int(skip_counts(trainer.state.opt_state)["total"]) == 2
  # The last good checkpoint is intact and holds finite parameters.
  latest = trainer.ckpt.latest_step()
  params = trainer.ckpt.restore_params(latest)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(good)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dataset_that_runs_out_saves_and_stops(tmp_path):
  cfg = smoke(tmp_path, "train.steps=5", "data.num_epochs=1")
  cfg.data.sources = [dict(kind="arithmetic", weight=1.0, verifier="none", difficulty=1, seed=0,
                           num_examples=20)]
  trainer = Trainer(cfg)
  with pytest.raises(DataExhausted, match="num_epochs"):
    trainer.run()
  # 20 examples at 8 prompts a step: 2 full steps ran, and a checkpoint of step 2 exists.
  assert trainer.ckpt.latest_step() == 2
  assert int(trainer.state.step) == 2


def _run_steps(cfg, n):
  trainer = Trainer(cfg)
  metrics = [trainer.run_step() for _ in range(n)]
  params = jax.device_get(trainer.state.params)
  trainer.scorer.pool.close()
  return metrics, params


def test_sharded_step_matches_single_device(tmp_path):
  """The fused step on mesh (2, 2, 2) reproduces the pure data-parallel mesh (8, 1, 1): same
  rollouts, same update. (A mesh must use every device, so one device is the reference in
  tests/test_mesh.py, in a subprocess of its own; here both runs use the 8 of this process.)

  The logits of two meshes differ in their last bits (other matmul blockings and reduction
  orders); the sampler's Gumbel-max draw keeps the tokens identical regardless (docs/sampling.md).
  Tolerances from float32 arithmetic (u = 2**-24): sums of n terms in another order differ by
  about u * sqrt(n) of their magnitude; the longest reductions are the softmax over 49152
  vocabulary entries and the 512 trained tokens, so gradients agree to rho = 2e-5 of their norm.
  The parameters: Adam's elementwise step lr * m / (sqrt(v) + eps) has a derivative with respect
  to the gradient of at most lr/eps (first step) and about 2 lr/eps (second), so over 2 steps the
  parameters differ by at most 3 (lr/eps) rho max||g|| in L2. With eps = 1e-8 (the default) the
  bound says nothing: an element whose gradient is near eps turns a last-bit difference into a
  step of up to lr (what made "99.99% of parameters close" fail on a fresh machine); eps = 1e-3
  makes it 2e-3 here, against parameter moves 100 times larger.
  """
  lr, eps, rho = 0.1, 1e-3, 2e-5
  opt = (f"optim.learning_rate={lr}", f"optim.eps={eps}")
  one, p_one = _run_steps(smoke(tmp_path / "a", "mesh.shape=(8, 1, 1)", *opt), 2)
  eight, p_eight = _run_steps(smoke(tmp_path / "b", "mesh.shape=(2, 2, 2)", *opt), 2)
  for a, b in zip(one, eight):
    assert a["verifier/failures"] == b["verifier/failures"] == 0   # else rewards hold fallbacks
    assert a["sampler/tokens"] == b["sampler/tokens"]
    assert a["reward/mean"] == b["reward/mean"]
    assert b["loss"] == pytest.approx(a["loss"], rel=rho, abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rho)
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)]).astype(np.float64) for p in (p_one, p_eight))
  bound = 3 * (lr / eps) * rho * max(m["grad_norm"] for m in one)
  assert np.linalg.norm(a - b) <= bound, (np.linalg.norm(a - b), bound)


def test_resume_is_exact(tmp_path):
  """4 steps straight == 2 steps, stop, resume from the checkpoint, 2 more steps (bitwise on CPU)."""
  straight = Trainer(smoke(tmp_path / "straight", "train.steps=4"))
  want = read_metrics(straight.run()["metrics_file"])
  want_params = jax.device_get(straight.state.params)

  cfg = lambda: smoke(tmp_path / "split", "train.steps=4")
  first = Trainer(cfg())
  got = [first.run_step() for _ in range(2)]
  first.save()
  first.ckpt.wait()
  first.scorer.pool.close()
  resumed = Trainer(cfg())
  assert resumed.start_step == 2
  got += read_metrics(resumed.run()["metrics_file"])
  assert len(got) == len(want) == 4
  for step, (a, b) in enumerate(zip(got, want)):
    for key in ("reward/mean", "loss", "grad_norm", "sampler/tokens"):
      assert a[key] == b[key], (step, key)
  for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.params)), jax.tree.leaves(want_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


RECIPES = ["qwen25_05b_gsm8k_grpo.py", "qwen25_7b_gsm8k_lora_grpo.py", "qwen3_17b_math_dapo.py",
           "llama32_1b_countdown_drgrpo.py", "default.py", "gemma3_1b_gsm8k_grpo.py"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_one_step_dry_run_on_a_tiny_model(tmp_path, name):
  """Each real-scale recipe's settings, on a tiny random model and local data, for one step."""
  cfg = load_config_file(os.path.join(CONFIGS, name))
  data = tmp_path / "train.jsonl"
  rows = [{"question": f"What is {i} + {i}?", "answer": f"so #### {2 * i}",
           "problem": f"Compute {i}+1.", "solution": f"\\boxed{{{i + 1}}}"} for i in range(32)]
  data.write_text("\n".join(json.dumps(r) for r in rows))
  for src in cfg.data.sources:
    if "path" in src:
      src["path"] = str(data)
  apply_overrides(cfg, [
      "model.path='random'", "tokenizer='smollm2-135m-instruct'", "model.dtype='float32'",
      "model.random.hidden_size=32", "model.random.intermediate_size=64", "model.random.head_dim=8",
      "sampling.max_new_tokens=8", "data.max_prompt_tokens=192", "train.steps=1", "optim.warmup_steps=0",
      "train.prompts_per_step=4",
      f"output.dir={str(tmp_path / 'run')!r}", "output.export_hf=False", "eval.every=0",
      "eval.before_and_after=False", "checkpoint.every=0", "output.progress=False"])
  if cfg.train.mini_batches > 4:
    cfg.train.mini_batches = 4
  for comp in cfg.rewards.components:
    if comp["verifier"] == "overlong":
      comp["kwargs"] = dict(max_len=8, buffer=4)
  cfg.rl.agg_norm = 8.0 if cfg.rl.agg_norm is not None else None
  summary = Trainer(cfg).run()
  metrics = read_metrics(summary["metrics_file"])
  assert len(metrics) == 1 and np.isfinite(metrics[0]["loss"])


def test_ignore_eos_fills_every_completion(tmp_path):
  """sampling.ignore_eos: rollouts run to max_new_tokens; evaluation still stops at EOS."""
  cfg = smoke(tmp_path, "sampling.ignore_eos=True")
  trainer = Trainer(cfg)
  m = trainer.run_step()
  trainer.scorer.pool.close()
  rows = cfg.train.prompts_per_step * cfg.sampling.num_samples
  assert trainer.spec.eos_ids == ()
  assert m["sampler/tokens"] == rows * cfg.sampling.max_new_tokens
  assert m["truncation_rate"] == 1.0
  from rljax.trainer.loop import sampling_params
  assert sampling_params(cfg, trainer.tokenizer, greedy=True).stop_token_ids  # what evaluate() uses


def test_first_step_metrics_do_not_depend_on_micro_batches(tmp_path):
  """Logged metrics combine over micro-batches by their reduction (sum of globally normalised
  parts, max, min), so 1 and 4 micro-batches log the same first step: same rollout, same loss,
  same clip fractions, lengths, entropy and token counts (not divided by 4, maxima not averaged).
  The parts sum in another order: float32 rounding, relative 1e-5."""
  one, _ = _run_steps(smoke(tmp_path / "a", "train.micro_batches=1", "rl.entropy_coef=0.01"), 1)
  four, _ = _run_steps(smoke(tmp_path / "b", "train.micro_batches=4", "rl.entropy_coef=0.01"), 1)
  a, b = one[0], four[0]
  skip = ("time/", "perf/", "throughput/", "compile/", "verifier/seconds", "verifier/items_per_s")
  keys = [k for k in a if not k.startswith(skip)]
  for key in ("num_tokens", "entropy", "response_length_max", "response_length_mean", "clip_frac_low", "loss"):
    assert key in keys, key
  for key in keys:
    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
  assert a["num_tokens"] == a["sampler/tokens"]        # every sampled token is trained (no dynamic sampling)
