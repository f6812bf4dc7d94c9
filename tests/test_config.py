"""Config loading, overrides and validation: every bad config names its field."""
import os

import pytest

from rljax import config as config_lib
from rljax.config import apply_overrides, load_config_file, resolve_config, split_config_args
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


# ---- issue 22: every bad input stops early with a message naming the field or file and the fix ----


def test_integer_field_refuses_a_fraction():
  with pytest.raises(ConfigError, match=r"--config\.train\.steps=5\.5: the field holds a whole number.*steps=5"):
    _cfg("train.steps=5.5")
  assert _cfg("optim.learning_rate=1").optim.learning_rate == 1.0     # an int where a float is expected is fine


def test_config_file_must_be_python_or_gin(tmp_path):
  txt = tmp_path / "recipe.txt"
  txt.write_text("def get_config(): pass\n")
  with pytest.raises(ConfigError, match=r"recipe\.txt' is neither a Python recipe \(\.py.*nor a gin file"):
    load_config_file(str(txt))
  with pytest.raises(ConfigError, match="does not exist"):
    load_config_file(str(tmp_path))                     # a directory
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config():\n  return {'train': 1}\n")
  with pytest.raises(ConfigError, match=r"get_config\(\) returned a dict"):
    load_config_file(str(bad))


def test_unknown_preset_names_the_field_and_lists_the_presets():
  with pytest.raises(ConfigError) as e:
    config_lib.validate(_cfg("rl.preset='grpoo'"))
  msg = str(e.value)
  assert "config.rl.preset='grpoo'" in msg and "Did you mean 'grpo'?" in msg
  assert all(name in msg for name in ("dapo", "dr_grpo", "gspo", "rloo"))


def test_group_of_one_names_sampling_num_samples_and_the_fix():
  with pytest.raises(ConfigError, match=r"config\.sampling\.num_samples=1: rl\.preset='grpo' uses rl\.std_scope='group'"
                                        r".*sampling\.num_samples >= 2.*rl\.std_scope='batch'"):
    config_lib.validate(_cfg("sampling.num_samples=1"))
  config_lib.validate(_cfg("sampling.num_samples=1", "rl.std_scope='none'", "rl.mean_scope='batch'"))


def test_model_context_is_read_without_loading_weights(tmp_path):
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text('{"max_position_embeddings": 64}')
  cfg = _cfg(f"model.path={str(hf)!r}")
  assert config_lib.model_context_length(cfg.model) == 64
  with pytest.raises(ConfigError, match=r"49 \+ 16 = 65 exceeds the context .*\(64 tokens\)"):
    config_lib.check_model_fits_early(_cfg(f"model.path={str(hf)!r}", "data.max_prompt_tokens=49"))
  assert config_lib.model_context_length(_cfg("model.path='random'").model) == config_lib.RANDOM_MODEL_CONTEXT
  assert config_lib.model_context_length(_cfg(f"model.path={str(tmp_path / 'nothing')!r}").model) is None
  # The built-in SmolLM2's GGUF header: read in well under a second, no tensors touched.
  assert config_lib.model_context_length(_cfg().model) == 8192
  with pytest.raises(ConfigError, match=r"exceeds the context of model\.path='smollm2-135m-instruct' \(8192"):
    config_lib.check_model_fits_early(_cfg("sampling.max_new_tokens=9000"))


def test_evaluating_on_the_training_file_is_refused(tmp_path):
  one_file = "data.sources=[{'kind': 'gsm8k', 'path': '/data/train.jsonl'}]"
  with pytest.raises(ConfigError, match=r"config\.data\.sources\[0\]\.path='/data/train\.jsonl'.*training prompts.*"
                                        r"path=\{'train'.*eval\.allow_training_data=True"):
    config_lib.validate(_cfg(one_file))
  config_lib.validate(_cfg(one_file, "eval.allow_training_data=True"))
  config_lib.validate(_cfg(one_file, "eval.before_and_after=False"))       # no evaluation, nothing to refuse
  config_lib.validate(_cfg("data.sources=[{'kind': 'gsm8k', 'path': {'train': 'a.jsonl', 'test': 'b.jsonl'}}]"))


@pytest.mark.parametrize("name", ["qwen25_05b_gsm8k_grpo.py", "qwen3_17b_math_dapo.py",
                                  "gemma3_1b_gsm8k_grpo.py"])
def test_recipe_docstring_data_override_is_a_correct_two_split_override(name):
  """The override each recipe's docstring shows must validate (it used to read train.jsonl for eval)."""
  import re
  path = os.path.join(CONFIGS, name)
  doc = open(path).read().split('"""')[1]
  m = re.search(r"--config\.data\.sources='(.*?)'", doc, re.S)
  assert m, f"{name}'s docstring shows no data override"
  cfg = load_config_file(path)
  apply_overrides(cfg, [f"data.sources={' '.join(m.group(1).split())}"])
  config_lib.validate(cfg)
  assert set(cfg.data.sources[0]["path"]) == {"train", "test"}


def test_field_help_and_describe():
  help_ = config_lib.field_help()
  assert "rollout steps" in help_["train.steps"] and "G: completions per prompt" in help_["sampling.num_samples"]
  assert "dr_grpo" in help_["rl.preset"] and "leave-one-out" in help_["rl.mean_scope"]
  # Every field and section is documented where it is declared (rljax/config/schema.py).
  fields = config_lib.flatten(config_lib.base_config().to_dict())
  sections = {name.rsplit(".", i)[0] for name in fields for i in range(1, name.count(".") + 1)}
  assert set(fields) | sections <= set(help_) and all(help_[name] for name in set(fields) | sections)
  text = config_lib.describe_fields(_cfg())
  assert "train.steps = 24   (default 10)" in text and "# rollout steps" in text
  assert "tokenizer = \"\"" in text and "rl.clip_high = null" in text
