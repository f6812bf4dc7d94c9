"""Settings that used to pass validation and fail later (issue 37): each is refused by name, before
anything heavy starts (validation only reads the config, and a model's config.json)."""
import json

import pytest

from rljax.config import base_config
from rljax.config.overrides import apply_overrides
from rljax.config.validation import validate
from rljax.errors import ConfigError


def one_arg_verifier(completion):
  """Takes no example: the pool could never call it."""
  return 1.0


def _config(*overrides):
  c = base_config()
  c.model.path = "random"
  apply_overrides(c, list(overrides))
  return c


@pytest.mark.parametrize("overrides,pattern", [
    (["optim.learning_rate=1e999"], r"config.optim.learning_rate=inf must be a finite number"),
    (["rewards.timeout_s=1e999"], r"config.rewards.timeout_s=inf must be a finite number"),
    (["tools.timeout_s=1e999"], r"config.tools.timeout_s=inf must be a finite number"),
    (["rewards.batch_deadline_s=1e7"], r"config.rewards.batch_deadline_s must be a positive, finite number of "
                                       r"seconds \(at most a day\), got 10000000.0"),
    (["model.lora.rank=65"], r"config.model.lora.rank=65 is larger than the model's hidden size \(64, from "
                             r"config.model.random.hidden_size\)"),
    (["mesh.shape=(4,1,1)", "train.prompts_per_step=6"], r"config.train.prompts_per_step=6 is not divisible by the "
                                                         r"data axis of config.mesh.shape=\(4, 1, 1\) \(4\)"),
])
def test_settings_that_would_fail_late_are_refused(overrides, pattern):
  with pytest.raises(ConfigError, match=pattern):
    validate(_config(*overrides))


def test_rewards_are_validated_with_the_config():
  c = _config()
  c.rewards.components = [dict(name="bad", verifier="test_config_limits:one_arg_verifier")]
  with pytest.raises(ConfigError, match=r"config.rewards.components\[0\] \('bad'\): verifier "
                                        r"'test_config_limits:one_arg_verifier' cannot be called as "
                                        r"one_arg_verifier\(completion, example\)"):
    validate(c)
  c.rewards.components = [dict(name="x", verifier="arithmetic", kwargs={"nope": 1})]
  with pytest.raises(ConfigError, match=r"config.rewards.components\[0\] \('x'\).kwargs: verifier 'arithmetic' takes "
                                        r"no keyword argument 'nope'"):
    validate(c)
  # the limits themselves pass
  validate(_config("mesh.shape=(4,1,1)", "train.prompts_per_step=8", "model.lora.rank=64"))


def test_lora_rank_is_checked_against_a_model_directory(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 48, "model_type": "llama"}))
  c = _config("model.lora.rank=64")
  c.model.path = str(tmp_path)
  with pytest.raises(ConfigError, match=f"larger than the model's hidden size \\(48, from {tmp_path}/config.json\\)"):
    validate(c)


def test_get_config_that_raises_is_a_clear_error_without_traceback(tmp_path, capsys):
  from rljax.cli import main
  recipe = tmp_path / "broken.py"
  recipe.write_text("from rljax.config import base_config\n\n\ndef get_config():\n  c = base_config()\n"
                    "  return c.no_such_section.x\n")
  assert main(["config", "show", "--config", str(recipe)]) == 1  # the CLI's RljaxError path: no traceback
  err = capsys.readouterr().err
  assert f"config file '{recipe}': get_config() raised AttributeError" in err and "(line 6)" in err, err
