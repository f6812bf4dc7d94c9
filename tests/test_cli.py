"""The `rljax` command line as a new user meets it (issue 22): help, version, messages instead of
tracebacks, resume that tells the truth, and output a person can follow."""
import json
import os
import re
import subprocess
import sys

import pytest

from rljax import cli
from rljax.config import apply_overrides, load_config_file
from rljax.trainer import rundir

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = os.path.join(ROOT, "rljax", "configs")
SMOKE = os.path.join(CONFIGS, "smoke.py")


def rljax(*args, timeout=120, **kw):
  """`rljax ARGS` in a subprocess: (exit status, stdout, stderr)."""
  cache = kw.pop("cache", os.environ.get("RLJAX_CACHE_DIR", ""))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "RLJAX_CACHE_DIR": cache}
  env = {k: v for k, v in env.items() if v != ""}
  proc = subprocess.run([sys.executable, "-m", "rljax.cli", *args], capture_output=True, text=True, timeout=timeout,
                        env=env, **kw)
  return proc.returncode, proc.stdout, proc.stderr


def fake_run(out_dir, *overrides, steps=(20,)):
  """A finished smoke run directory as training leaves it (config.json, complete checkpoint steps,
  summary.json), without training."""
  cfg = load_config_file(SMOKE)
  apply_overrides(cfg, [f"output.dir={str(out_dir)!r}", *overrides])
  rundir.write_config(cfg, str(out_dir))
  for step in steps:
    d = os.path.join(out_dir, "checkpoints", str(step))
    for item in ("state", "format"):
      os.makedirs(os.path.join(d, item))
    open(os.path.join(d, "_CHECKPOINT_METADATA"), "w").write("{}")
  rundir.write_summary(str(out_dir), max(steps), {"output_dir": str(out_dir)})
  return cfg


def snapshot(directory):
  """{relative path: (size, mtime_ns)} of every file under `directory`."""
  out = {}
  for root, _, files in os.walk(directory):
    for f in files:
      p = os.path.join(root, f)
      st = os.stat(p)
      out[os.path.relpath(p, directory)] = (st.st_size, st.st_mtime_ns)
  return out


# ---- item 7: help, version, the commands ----------------------------------------------------------


def test_version_matches_the_package():
  rc, out, _ = rljax("--version")
  version = re.search(r'^version = "([^"]+)"', open(os.path.join(ROOT, "pyproject.toml")).read(), re.M).group(1)
  assert rc == 0 and out.strip() == f"rljax {version}"


def test_train_help_documents_config_overrides_and_where_the_fields_are():
  rc, out, err = rljax("train", "--help")
  assert rc == 0, err
  for text in ("--config FILE", "--config.FIELD=VALUE", "Python literal", "rljax config show", "--gin_file",
               "--gin_bindings", "--dry-run", "--overwrite", "train.steps", "--config.output.dir"):
    assert text in out, text
  rc, out, _ = rljax("--help")
  assert rc == 0 and all(f"\n  {c} " in out for c in ("train", "eval", "config", "plan")) and "--version" in out


def test_config_show_lists_every_field_with_default_and_help():
  rc, out, err = rljax("config", "show", "--config", SMOKE, "--config.train.steps=3")
  assert rc == 0, err
  assert "train.steps = 3   (default 10)" in out and "# rollout steps" in out
  assert "sampling.num_samples = 8" in out and "# G: completions per prompt" in out
  assert out.rstrip().endswith("# validation: OK")


def test_plan_subcommand_dispatches_to_rljax_plan(capsys):
  """`rljax plan` reaches rljax.plan.main (its own flags appear in the help)."""
  with pytest.raises(SystemExit) as exit_:
    cli.main(["plan", "--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert "--topology" in out and "--json" in out and "--dump-hlo" in out


def test_unknown_command_suggests_one(capsys):
  assert cli.main(["trian"]) == 2
  assert "Did you mean 'train'?" in capsys.readouterr().err


# ---- items 4 and 5: a message naming the field or file and the fix, never a traceback ------------


@pytest.mark.parametrize("args, pattern", [
    (["--config.train.steps=5.5"], r"train\.steps=5\.5: the field holds a whole number"),
    (["--config", "{tmp}/recipe.txt"], r"neither a Python recipe \(\.py"),
    (["--config.output.dir={tmp}/afile/run"], r"config\.output\.dir=.*afile/run' cannot be created: .*afile is a file"),
    (["--config", "{tmp}/typo.gin"], r"config field 'train\.stepz' does not exist\. Did you mean 'train\.steps'"),
])
def test_bad_input_is_a_message_not_a_traceback(tmp_path, args, pattern):
  (tmp_path / "recipe.txt").write_text(open(SMOKE).read())
  (tmp_path / "afile").write_text("")
  (tmp_path / "typo.gin").write_text("train.stepz = 3\n")
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  if "--config" not in args:
    args = ["--config", SMOKE, *args]
  if not any("output.dir" in a for a in args):
    args.append(f"--config.output.dir={tmp_path / 'run'}")
  rc, out, err = rljax("train", *args)
  assert rc == 1 and "Traceback" not in err, err[-3000:]
  assert re.search(pattern, err), err[-3000:]
  assert not (tmp_path / "run").exists()


def _main_error(capsys, *args):
  rc = cli.main(["train", "--config", SMOKE, *args])
  err = capsys.readouterr().err
  assert rc == 1 and "Traceback" not in err
  return err


def test_weaker_messages_name_the_field_and_the_fix(tmp_path, capsys):
  out = f"--config.output.dir={tmp_path / 'run'}"
  err = _main_error(capsys, out, "--config.sampling.num_samples=1")
  assert "config.sampling.num_samples=1" in err and "rl.std_scope" in err
  err = _main_error(capsys, out, "--config.rl.preset=grpoo")
  assert "config.rl.preset='grpoo'" in err and "Did you mean 'grpo'?" in err and "dr_grpo" in err
  err = _main_error(capsys, out, "--config.sampling.max_new_tokens=5000")   # caught before the model loads
  assert "= 5016 exceeds the context of model.path='random' (4096 tokens)" in err
  assert not (tmp_path / "run").exists()


def test_source_without_valid_rows_and_eval_on_the_training_file(tmp_path, capsys):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"q": "1 + 1"}\n{"q": "2 + 2"}\n')
  source = f"--config.data.sources=[{{'kind': 'jsonl', 'path': '{bad}', 'verifier': 'none'}}]"
  err = _main_error(capsys, f"--config.output.dir={tmp_path / 'run'}", source)
  assert f"{bad} line 1: missing prompt field 'prompt'" in err and "none of its 2 rows" in err
  err = _main_error(capsys, f"--config.output.dir={tmp_path / 'run'}", source, "--config.eval.before_and_after=True")
  assert "config.data.sources[0].path=" in err and "path={'train'" in err and "eval.allow_training_data" in err


# ---- item 1: resume that tells the truth ----------------------------------------------------------


def test_rerun_with_changed_settings_is_flagged(tmp_path):
  out = tmp_path / "run"
  fake_run(out)
  before = snapshot(out)
  rc, stdout, err = rljax("train", "--config", SMOKE, f"--config.output.dir={out}", "--config.rollout.mode=pipelined")
  assert rc == 1 and "Traceback" not in err
  assert 'rollout.mode: "fused" -> "pipelined"' in err
  assert "--config.output.dir=" in err and "--overwrite" in err
  assert snapshot(out) == before                          # the failed start wrote nothing


def test_finished_run_says_so_and_how_to_extend_it(tmp_path):
  out = tmp_path / "run"
  fake_run(out)                                           # smoke: train.steps=20, checkpoint at step 20
  before = snapshot(out)
  rc, stdout, err = rljax("train", "--config", SMOKE, f"--config.output.dir={out}")
  assert rc == 0, err
  assert "is finished" in stdout and "nothing to train" in stdout and "--config.train.steps=40" in stdout
  assert "run finished" not in stdout                     # it did not pretend to have run
  assert snapshot(out) == before


def test_dry_run_builds_whatever_the_run_dir_holds_and_writes_nothing(tmp_path, capsys):
  """Issue 39 item 6: a dry run validates and builds the run even where a real start would stop
  (another config, a finished run) and says what a real start would do; it writes nothing there."""
  out = tmp_path / "run"
  fake_run(out, "output.progress=False")                  # a finished run; its config differs in an allowed field
  (out / "metrics.jsonl").write_text('{"step": 20, "loss": 1.0}\n')
  before = snapshot(out)
  for extra, note in ((["--config.rollout.mode=pipelined"], 'a real start would stop here: .* rollout.mode: "fused" '
                                                            '-> "pipelined"'),
                      ([], "a real start would do nothing: the run in .* is finished"),
                      (["--overwrite"], "a real start would delete the earlier run's outputs in .*: .*checkpoints")):
    assert cli.main(["train", "--config", SMOKE, f"--config.output.dir={out}", *extra, "--dry-run"]) == 0
    stdout = capsys.readouterr().out
    assert "config OK; model random (" in stdout and re.search(note, stdout, re.S), stdout
    assert snapshot(out) == before


def test_overwrite_deletes_nothing_until_the_new_run_is_built(tmp_path, capsys):
  """Item 1: `--overwrite` with a model path that does not exist, or whose weights fail to load,
  stops with the earlier run intact."""
  out = tmp_path / "run"
  fake_run(out)
  (out / "metrics.jsonl").write_text('{"step": 20, "loss": 1.0}\n')
  before = snapshot(out)
  err = _main_error(capsys, f"--config.output.dir={out}", "--overwrite", f"--config.model.path={tmp_path / 'nope'}")
  assert "model.path" in err and "nope" in err
  assert snapshot(out) == before
  broken = tmp_path / "broken"                            # a config.json (the context checks pass), no weights
  broken.mkdir()
  (broken / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))
  err = _main_error(capsys, f"--config.output.dir={out}", "--overwrite", f"--config.model.path={broken}")
  assert "the earlier run's outputs in" in err and "are kept" in err, err
  assert snapshot(out) == before


def test_a_run_writes_each_step_once_and_shows_its_progress(tmp_path):
  """An interrupted attempt (no checkpoint yet) left rows in metrics.jsonl: the new run replaces them,
  so each step has one row (a run resumed from step N keeps rows up to N: test_metrics_writer.py).
  The smoke recipe announces itself and shows a progress bar; config.json is written once training starts."""
  out = tmp_path / "run"
  out.mkdir()
  (out / "metrics.jsonl").write_text('{"step": 1, "loss": 123.0}\n{"step": 2, "loss": 123.0}\n')
  rc, stdout, err = rljax("train", "--config", SMOKE, f"--config.output.dir={out}", "--config.train.steps=1",
                          "--config.output.tensorboard=False", "--config.checkpoint.async_save=False", timeout=300)
  assert rc == 0, err[-3000:]
  assert "rljax train:" in stdout and f"writing to {out}" in stdout and "run finished" in stdout
  assert re.search(r"train: .*1/1", err), err[-2000:]
  rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1] and rows[0]["loss"] != 123.0
  assert json.load(open(out / "config.json"))["train"]["steps"] == 1
  assert rundir.checkpoint_steps(str(out)) == [1]
