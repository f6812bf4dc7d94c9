"""Run-directory bookkeeping: resume only with the same config, finished runs, starting over, one row per step."""
import json
import os

import pytest

from rljax.config import apply_overrides, load_config_file
from rljax.errors import ConfigError
from rljax.trainer import rundir
from rljax.trainer.rundir import RunFinished

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")


def smoke(out_dir, *overrides):
  cfg = load_config_file(os.path.join(CONFIGS, "smoke.py"))
  apply_overrides(cfg, [f"output.dir={str(out_dir)!r}", *overrides])
  return cfg


def fake_run(out_dir, cfg, steps=(10, 20), config_json=True):
  """A run directory as a run leaves it, without training: config.json and complete checkpoint steps."""
  os.makedirs(out_dir, exist_ok=True)
  if config_json:
    rundir.write_config(cfg, str(out_dir))
  for step in steps:
    d = os.path.join(out_dir, "checkpoints", str(step))
    os.makedirs(os.path.join(d, "extras"), exist_ok=True)
    open(os.path.join(d, "_CHECKPOINT_METADATA"), "w").write("{}")
    json.dump({"config": rundir.config_dict(cfg)}, open(os.path.join(d, "extras", "metadata"), "w"))
  # An orbax save in flight is not a checkpoint.
  os.makedirs(os.path.join(out_dir, "checkpoints", "30.orbax-checkpoint-tmp-1"), exist_ok=True)
  return out_dir


def test_fresh_directory_and_checkpoint_scan(tmp_path):
  cfg = smoke(tmp_path / "run")
  run = rundir.check_resume(cfg)
  assert (run.latest_step, run.resuming, run.start_over) == (None, False, False)
  assert not (tmp_path / "run").exists()              # checking writes nothing
  fake_run(tmp_path / "run", cfg)
  assert rundir.checkpoint_steps(str(tmp_path / "run")) == [10, 20]


def test_same_config_resumes_and_allowed_fields_may_change(tmp_path):
  cfg = smoke(tmp_path / "run", "train.steps=40")
  fake_run(tmp_path / "run", smoke(tmp_path / "run"))   # saved with train.steps=20
  changed = smoke(tmp_path / "run", "train.steps=40", "output.progress=False", "eval.num_examples=8",
                  "checkpoint.every=5", "mesh.shape=(2, 1, 1)", "model.remat=True", "rewards.num_workers=2")
  for c in (cfg, changed):
    run = rundir.check_resume(c)
    assert run.resuming and run.latest_step == 20 and run.previous["train"]["steps"] == 20


def test_changed_config_lists_the_fields_and_the_ways_out(tmp_path):
  fake_run(tmp_path / "run", smoke(tmp_path / "run"))
  cfg = smoke(tmp_path / "run", "rollout.mode='pipelined'", "model.random.hidden_size=64", "train.steps=40")
  with pytest.raises(ConfigError) as e:
    rundir.check_resume(cfg)
  msg = str(e.value)
  assert 'rollout.mode: "fused" -> "pipelined"' in msg and "model.random.hidden_size: 32 -> 64" in msg
  assert "train.steps" not in msg.split("Fields that may change")[0]     # allowed, so not listed as a difference
  assert "--config.output.dir=" in msg and "--overwrite" in msg and "checkpoint.resume=False" in msg


def test_finished_run_says_how_to_extend_it(tmp_path):
  cfg = smoke(tmp_path / "run")                      # train.steps=20, the latest checkpoint is step 20
  fake_run(tmp_path / "run", cfg)
  with pytest.raises(RunFinished, match=r"finished.*step 20.*train\.steps=20.*--config\.train\.steps=40"):
    rundir.check_resume(cfg)
  assert rundir.check_resume(cfg, allow_finished=True).resuming


def test_starting_over_needs_consent_and_deletes_only_run_outputs(tmp_path):
  out = tmp_path / "run"
  fake_run(out, smoke(out))
  for name in ("metrics.jsonl", "eval_before.jsonl", "eval_after.jsonl", "notes.txt"):
    (out / name).write_text("x\n")
  (out / "tb").mkdir()
  with pytest.raises(ConfigError, match=r"checkpoint\.resume=False.*step 20.*--overwrite"):
    rundir.check_resume(smoke(out, "checkpoint.resume=False"))
  run = rundir.check_resume(smoke(out, "rollout.mode='pipelined'"), overwrite=True)
  assert run.start_over and not run.resuming
  removed = rundir.clear_run(str(out))
  assert sorted(os.path.basename(p) for p in removed) == [
      "checkpoints", "config.json", "eval_after.jsonl", "eval_before.jsonl", "metrics.jsonl", "tb"]
  assert sorted(os.listdir(out)) == ["notes.txt"]     # anything else in the directory stays
  assert rundir.check_resume(smoke(out)).latest_step is None


def test_saved_config_falls_back_to_the_checkpoint_copy(tmp_path):
  out = tmp_path / "run"
  fake_run(out, smoke(out), config_json=False)
  assert rundir.saved_config(str(out))["train"]["steps"] == 20
  with pytest.raises(ConfigError, match="sampling.num_samples: 8 -> 4"):
    rundir.check_resume(smoke(out, "sampling.num_samples=4", "train.steps=40"))


def test_a_field_added_since_counts_as_its_default(tmp_path):
  out = tmp_path / "run"
  cfg = smoke(out, "train.steps=40")
  fake_run(out, smoke(out))
  saved = json.load(open(out / "config.json"))
  del saved["eval"]["allow_training_data"], saved["rollout"]["mode"]   # an older rljax wrote these without them
  json.dump(saved, open(out / "config.json", "w"))
  assert rundir.check_resume(cfg).resuming
  with pytest.raises(ConfigError, match="rollout.mode"):
    rundir.check_resume(smoke(out, "train.steps=40", "rollout.mode='pipelined'"))


@pytest.mark.parametrize("make, pattern", [
    (lambda p: (p / "file").write_text("x") and str(p / "file" / "run"), r"output\.dir=.*file.* is a file"),
    (lambda p: (p / "file").write_text("x") and str(p / "file"), r"output\.dir=.*is a file, not a directory"),
    (lambda p: "", r"output\.dir is empty"),
])
def test_output_dir_that_cannot_be_created(tmp_path, make, pattern):
  with pytest.raises(ConfigError, match=pattern):
    rundir.check_output_dir(make(tmp_path))


def test_metrics_purge_keeps_rows_up_to_the_resumed_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1}, {"step": 2}, {"step": 2, "eval/accuracy": 0.6}, {"step": 3}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')   # cut off by a crash
  assert rundir.metrics_purge_step(2) == 3 and rundir.metrics_purge_step(0) == 0
  assert rundir.purge_metrics(str(path), 3) == 2
  assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
  assert rundir.purge_metrics(str(path), 0) == 4 and path.read_text() == ""
