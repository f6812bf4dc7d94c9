"""Config loading, overrides and validation: every bad config names its field."""
import os

import pytest

from rljax import config as config_lib
from rljax.cli import resolve_config
from rljax.config_overrides import apply_overrides, load_config_file, split_config_args
from rljax.errors import ConfigError

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")


def _cfg(*overrides):
  cfg = load_config_file(os.path.join(CONFIGS, "default.py"))
  apply_overrides(cfg, overrides)
  return cfg


def test_default_config_validates_and_overrides_apply():
  cfg, rest = resolve_config(["--config.rl.clip_high=0.28", "--config.train.steps", "3", "--dry-run"])
  assert rest == ["--dry-run"]
  assert cfg.train.steps == 3
  assert config_lib.loss_config(cfg).clip_high == 0.28
  assert config_lib.loss_config(cfg).kl_coef == 0.0   # the default recipe turns KL off


def test_split_config_args_forms():
  path, overrides, rest = split_config_args(["--config=x.py", "--config.a.b=1", "--other"])
  assert (path, overrides, rest) == ("x.py", ["a.b=1"], ["--other"])


@pytest.mark.parametrize("overrides, field", [
    (["train.stepz=3"], "train.stepz"),                                 # typo in a field name
    (["train.steps='ten'"], "train.steps"),                             # wrong type
    (["sampling.num_samples=0"], "sampling.num_samples"),               # out of range
    (["sampling.max_new_tokens=0"], "sampling.max_new_tokens"),
    (["sampling.top_p=1.5"], "sampling.top_p"),
    (["optim.learning_rate=-1.0"], "optim.learning_rate"),
    (["optim.schedule='cosin'"], "optim.schedule"),
    (["train.prompts_per_step=6", "train.mini_batches=4"], "train.prompts_per_step"),   # not divisible
    (["sampling.num_samples=1"], "std_scope"),                          # G=1 with group std
    (["rl.preset='grpoo'"], "grpoo"),                                   # unknown preset
    (["rl.clip_high=-0.1"], "clip_high"),                               # eps_high < 0
    (["rl.agg='token-means'"], "agg"),                                  # unknown aggregation mode
    (["optim.warmup_steps=1000"], "optim.warmup_steps"),                # longer than the run
    (["model.dtype='float64'"], "model.dtype"),
    (["mesh.shape=(2, 2)"], "mesh.shape"),
    (["sampling.temperature=-1.0"], "sampling.temperature"),
])
def test_bad_config_names_the_field(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    cfg = _cfg(*overrides)
    config_lib.validate(cfg)


def test_typo_suggests_the_right_field():
  with pytest.raises(ConfigError, match="Did you mean 'optim.learning_rate'"):
    _cfg("optim.learning_rat=1e-5")


def test_context_overflow_is_a_contradiction():
  cfg = _cfg("sampling.max_new_tokens=4000")
  with pytest.raises(ConfigError, match="max_new_tokens"):
    config_lib.check_model_fits(cfg, 2048)


def test_missing_config_file():
  with pytest.raises(ConfigError, match="does not exist"):
    load_config_file("/nonexistent/recipe.py")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".py") and f != "__init__.py"))
def test_every_recipe_validates(name):
  cfg = load_config_file(os.path.join(CONFIGS, name))
  config_lib.validate(cfg)


def test_free_form_mapping_and_list_overrides():
  """Empty mapping fields (tools.kwargs) take a dict; structured sections never do."""
  cfg = _cfg('tools.kwargs={"search": {"corpus_path": "docs.jsonl"}}', "sampling.stop_token_ids=[13, 198]")
  assert cfg.tools.kwargs.to_dict() == {"search": {"corpus_path": "docs.jsonl"}}
  assert list(cfg.sampling.stop_token_ids) == [13, 198]
  with pytest.raises(ConfigError, match="model"):
    _cfg('model={"path": "x"}')
