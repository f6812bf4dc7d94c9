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


def test_finished_run_says_how_to_extend_it_and_an_unfinished_end_is_completed(tmp_path):
  cfg = smoke(tmp_path / "run")                      # train.steps=20, the latest checkpoint is step 20
  fake_run(tmp_path / "run", cfg)
  # Stopped after its last checkpoint (no summary.json): a new start completes the end of the run.
  run = rundir.check_resume(cfg)
  assert run.resuming and run.finishing and run.latest_step == 20
  rundir.write_summary(str(tmp_path / "run"), 10, {"output_dir": "x"})   # an earlier, shorter attempt's
  assert rundir.check_resume(cfg).finishing
  rundir.write_summary(str(tmp_path / "run"), 20, {"output_dir": "x"})
  with pytest.raises(RunFinished, match=r"finished.*step 20.*train\.steps=20.*--config\.train\.steps=40"):
    rundir.check_resume(cfg)
  assert rundir.check_resume(cfg, allow_finished=True).resuming
  assert rundir.check_resume(smoke(tmp_path / "run", "train.steps=40")).finishing is False


def test_start_over_sets_outputs_aside_and_puts_them_back(tmp_path):
  """Item 1 of issue 39: nothing of an earlier run is deleted before the new start is built."""
  out = tmp_path / "run"
  fake_run(out, smoke(out))
  (out / "metrics.jsonl").write_text("x\n")
  (out / "notes.txt").write_text("mine\n")
  before = sorted(os.listdir(out))
  replaced = rundir.StartOver(str(out))
  assert sorted(replaced.set_aside()) == ["checkpoints", "config.json", "metrics.jsonl"]
  assert sorted(os.listdir(out)) == [rundir.REPLACED_DIR, "notes.txt"]
  (out / "checkpoints").mkdir()                      # what a failed build may leave: an empty directory
  replaced.restore()
  assert sorted(os.listdir(out)) == before and rundir.checkpoint_steps(str(out)) == [10, 20]
  # Killed between setting aside and building: the next start puts them back.
  rundir.StartOver(str(out)).set_aside()
  assert rundir.recover_replaced(str(out)) == ["checkpoints", "config.json", "metrics.jsonl"]
  assert sorted(os.listdir(out)) == before and rundir.recover_replaced(str(out)) == []
  replaced = rundir.StartOver(str(out))
  replaced.set_aside()
  replaced.commit()
  assert sorted(os.listdir(out)) == ["notes.txt"]


def test_metrics_helpers_for_a_completed_end(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0, "eval/accuracy": 0.5, "eval/accuracy_stderr": 0.1}\n{"step": 2, "loss": 1.0}\n'
                  '{"step": 2, "eval/accuracy": 0.7}\n')
  assert rundir.logged_eval(str(path), 0) == {"accuracy": 0.5, "accuracy_stderr": 0.1}
  assert rundir.drop_eval_rows(str(path), 2) == 1
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]


def test_run_lock_names_the_holder_and_outlives_no_process(tmp_path):
  """Item 3: one owner per run directory. A second process is refused with the holder's pid; the
  lock of a process that died (however) is free again; the holder itself may re-enter."""
  import subprocess
  import sys

  from rljax.trainer.runlock import RunDirInUse, RunLock, holder
  out = str(tmp_path / "run")
  hold = ("import sys, time; from rljax.trainer.runlock import RunLock\n"
          "with RunLock(sys.argv[1]):\n  print('held', flush=True); time.sleep(60)\n")
  proc = subprocess.Popen([sys.executable, "-c", hold, out], stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "held"
    assert holder(out)["pid"] == proc.pid
    message = rf"in use by another run: process {proc.pid} on host .*kill -TERM {proc.pid}"
    with pytest.raises(RunDirInUse, match=message):
      with RunLock(out):
        pass
  finally:
    proc.kill()
    proc.wait()
  assert holder(out) is None                         # the lock died with its process (its file stays: stale)
  with RunLock(out):
    with RunLock(out):                               # re-entrant in one process
      assert holder(out)["pid"] == os.getpid()
    assert os.path.exists(os.path.join(out, ".rljax.lock"))
  assert not os.path.exists(os.path.join(out, ".rljax.lock"))


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
