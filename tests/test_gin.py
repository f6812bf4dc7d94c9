"""gin files and bindings bind onto the same config schema and go through the same validation."""
import os
import subprocess
import sys

import pytest

from rljax import config as config_lib
from rljax.config import apply_gin, load_config_file, resolve_config, split_gin_args
from rljax.errors import ConfigError

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")


def test_default_gin_is_the_default_recipe():
  from_gin = load_config_file(os.path.join(CONFIGS, "default.gin"))
  from_py = load_config_file(os.path.join(CONFIGS, "default.py"))
  assert from_gin.to_dict() == from_py.to_dict()
  config_lib.validate(from_gin)


def test_bindings_macros_and_nested_sections():
  cfg = apply_gin(config_lib.base_config(), bindings=[
      "STEPS = 7", "train.steps = %STEPS", "model.random.hidden_size = 32", 'config.tokenizer = "x"',
      "mesh.shape = (2, 2, 2)", 'tools.kwargs = {"search": {"corpus_path": "c.jsonl"}}', "rl.clip_high = 0.28"])
  assert cfg.train.steps == 7 and cfg.model.random.hidden_size == 32 and cfg.tokenizer == "x"
  assert tuple(cfg.mesh.shape) == (2, 2, 2) and cfg.tools.kwargs.to_dict() == {"search": {"corpus_path": "c.jsonl"}}
  assert config_lib.loss_config(cfg).clip_high == 0.28


@pytest.mark.parametrize("binding, pattern", [
    ("train.stepz = 3", r"config field 'train\.stepz' does not exist\. Did you mean 'train\.steps'\?"),
    ("trian.steps = 3", r"'trian' is not a config section\. Did you mean 'train'\?"),
    ("model.random.hidden_sise = 3", r"'model\.random\.hidden_sise' does not exist\. Did you mean 'model\.random\.hidden_size'"),
    ("train.steps = 5.5", r"config\.train\.steps=5\.5: the field holds a whole number"),
    ("train.steps = 'ten'", r"config\.train\.steps='ten' has type str"),
    ("train.steps = ", r"Unable to parse"),
])
def test_bad_bindings_name_the_field(binding, pattern):
  with pytest.raises(ConfigError, match=pattern):
    apply_gin(config_lib.base_config(), bindings=[binding])


def test_gin_goes_through_validation_and_order_of_precedence(tmp_path):
  gin = tmp_path / "r.gin"
  gin.write_text("include '%s'\ntrain.steps = 3\nsampling.num_samples = 4\n" % os.path.join(CONFIGS, "default.gin"))
  cfg, rest = resolve_config(["--gin_file", str(gin), "--gin_bindings", "train.steps = 5",
                              "--config.train.steps=6", "--dry-run"])
  assert rest == ["--dry-run"] and cfg.train.steps == 6 and cfg.sampling.num_samples == 4
  assert cfg.data.max_prompt_tokens == 48                       # from the included default.gin
  with pytest.raises(ConfigError, match=r"sampling\.num_samples=1"):   # same validation as --config.FIELD=VALUE
    resolve_config(["--gin_file", str(gin), "--gin_bindings=sampling.num_samples = 1"])
  with pytest.raises(ConfigError, match="gin file .*missing.gin' does not exist"):
    resolve_config(["--gin_file", str(tmp_path / "missing.gin")])


def test_split_gin_args_forms():
  files, bindings, rest = split_gin_args(["--gin_file", "a.gin", "--gin_file=b.gin", "--gin_bindings", "x.y = 1",
                                          "--gin_bindings=z.w = 2", "--dry-run"])
  assert (files, bindings, rest) == (["a.gin", "b.gin"], ["x.y = 1", "z.w = 2"], ["--dry-run"])


def test_cli_reads_a_gin_file_as_config():
  """Issue 22 item 8: a .gin file passed as --config was a traceback; `rljax config show` resolves it."""
  proc = subprocess.run([sys.executable, "-m", "rljax.cli", "config", "show", "--config",
                         os.path.join(CONFIGS, "default.gin"), "--gin_bindings", "train.steps = 4"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert "train.steps = 4" in proc.stdout and "data.max_prompt_tokens = 48" in proc.stdout
  assert "# validation: OK" in proc.stdout
