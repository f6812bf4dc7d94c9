"""A smoke-size run that trains with every kind of reward at once (issue 35): a verifier, a reward
model and a judge on the mesh, and a remote judge over HTTP (a server on 127.0.0.1 in the test)."""
import os
import threading

import jax
import numpy as np
import pytest
from test_remote_judge import KEY, Judge
from test_reward_models import TOKENIZER, save_tiny

from rljax.config import apply_overrides, load_config_file
from rljax.tokenizer import load_tokenizer
from rljax.trainer.loop import Trainer

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")


@pytest.fixture
def judge_server(monkeypatch):
  monkeypatch.setenv("JUDGE_KEY", KEY)
  srv = Judge()
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  yield srv
  srv.shutdown()
  srv.server_close()


def test_a_run_trains_on_a_verifier_a_reward_model_a_judge_and_a_remote_judge(tmp_path, judge_server):
  tok = load_tokenizer(TOKENIZER)
  save_tiny(tmp_path / "rm", "qwen2", "model", tok, seed=1)
  save_tiny(tmp_path / "judge", "llama", "judge", tok, seed=2)
  cfg = load_config_file(os.path.join(CONFIGS, "smoke.py"))
  apply_overrides(cfg, [f"output.dir={str(tmp_path / 'run')!r}", "train.steps=2", "output.progress=False",
                        "train.prompts_per_step=8", "sampling.num_samples=4"])
  cfg.rewards.components = [
      dict(name="vowels", verifier="rljax.configs.smoke:vowel_fraction", weight=1.0),
      dict(name="rm", model=str(tmp_path / "rm"), weight=0.5),
      dict(name="judge", judge=str(tmp_path / "judge"), weight=0.5,
           template="Q: {prompt}\nA:\n{completion}\nIs it right? Reply yes or no.",
           kwargs=dict(yes=["yes"], no=["no"])),
      # The test server answers yes to a completion with 'good' in it and "Yes" to anything else.
      dict(name="remote", verifier="remote_judge", weight=0.25, kwargs=dict(
          base_url=judge_server.url, model="judge", template="Q: {prompt}\nA: {completion}\nOK?",
          api_key_env="JUDGE_KEY", timeout_s=5.0, total_timeout_s=20.0)),
  ]
  trainer = Trainer(cfg)
  before = jax.device_get(trainer.state.params)
  try:
    metrics = [trainer.run_step() for _ in range(2)]
    batch = trainer.scorer.reward_fn.last_batch()
  finally:
    trainer.close()
  for m in metrics:
    for name in ("vowels", "rm", "judge", "remote"):
      assert f"reward/{name}_mean" in m, name
    assert m["verifier/failures"] == 0 and np.isfinite(m["loss"])
  assert judge_server.paths["/v1/chat/completions"] >= 64            # every row went to the remote judge
  # Each row's reward is the weighted sum of the four kinds' scores (no gates).
  c = batch.components
  np.testing.assert_allclose(batch.rewards, c["vowels"] + 0.5 * c["rm"] + 0.5 * c["judge"] + 0.25 * c["remote"],
                             rtol=1e-5, atol=1e-6)
  assert np.ptp(c["rm"]) > 0 and np.ptp(c["judge"]) > 0 and ((c["judge"] > 0) & (c["judge"] < 1)).all()
  np.testing.assert_array_equal(c["remote"], 1.0)
  after = jax.device_get(trainer.state.params)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
