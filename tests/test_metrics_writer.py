"""MetricsWriter: JSONL rows and TensorBoard scalars with legal tags."""
import glob
import json
import math
import struct

from tensorboardX.proto import event_pb2

from rljax.trainer.metrics import MetricsWriter


def _tensorboard_scalars(directory):
  """{(tag, step): value} from every event file under `directory` (TFRecord framing)."""
  out = {}
  for path in glob.glob(f"{directory}/events.out.tfevents.*"):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for v in event.summary.value:
        out[(v.tag, event.step)] = v.simple_value
  return out


def test_writes_jsonl_and_tensorboard(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=True)
  w.write(1, {"loss": 0.5, "eval/pass@8": 0.25, "grad_norm": math.nan})
  w.write(2, {"loss": 0.25})
  w.close()
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows == [{"step": 1, "loss": 0.5, "eval/pass@8": 0.25, "grad_norm": None},
                  {"step": 2, "loss": 0.25}]
  scalars = _tensorboard_scalars(tmp_path / "tb")
  # '@' is not a legal TensorBoard tag character; non-finite values are left out.
  assert scalars == {("loss", 1): 0.5, ("eval/pass_at_8", 1): 0.25, ("loss", 2): 0.25}


def test_non_writing_process_creates_nothing(tmp_path):
  w = MetricsWriter(str(tmp_path / "run"), tensorboard=True, writing=False)
  w.write(1, {"loss": 0.5})
  w.close()
  assert not (tmp_path / "run").exists()


def _purge_events(directory):
  """Steps of the SessionLog START events (TensorBoard's purge marker) under `directory`."""
  out = []
  for path in glob.glob(f"{directory}/events.out.tfevents.*"):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        out.append(event.step)
  return out


def test_resumed_writer_writes_each_step_once(tmp_path):
  """A run resumed from the checkpoint of step 2 rewrites steps 3+: the rows an interrupted attempt
  wrote for them are dropped (JSONL) and purged (TensorBoard's purge_step)."""
  w = MetricsWriter(str(tmp_path), tensorboard=True, start_step=0)
  for step in (1, 2, 3, 4):            # the first attempt got to step 4; its last checkpoint was step 2
    w.write(step, {"loss": float(step)})
  w.close()
  w = MetricsWriter(str(tmp_path), tensorboard=True, start_step=2)
  for step in (3, 4, 5):
    w.write(step, {"loss": 10.0 + step})
  w.close()
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  assert [r["loss"] for r in rows] == [1.0, 2.0, 13.0, 14.0, 15.0]
  assert 3 in _purge_events(tmp_path / "tb")   # TensorBoard drops the first attempt's steps >= 3
  # A fresh start (step 0) replaces everything an earlier attempt wrote, its step-0 evaluation too.
  w = MetricsWriter(str(tmp_path), tensorboard=False, start_step=0)
  w.write(0, {"eval/accuracy": 0.5})
  w.close()
  assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [{"step": 0, "eval/accuracy": 0.5}]


def test_wandb_offline_run_continues_on_resume(tmp_path, monkeypatch):
  """config.output.wandb (issue 39 item 12): rows also go to a W&B run (offline here), and a resumed
  run logs to the same W&B run id. Skipped where the optional wandb package is absent."""
  import pytest
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_SILENT", "true")
  settings = {"project": "rljax-test", "name": "", "entity": "", "mode": "offline"}
  w = MetricsWriter(str(tmp_path), tensorboard=False, start_step=0, wandb=settings, config={"train": {"steps": 3}})
  for step in (1, 2):
    w.write(step, {"loss": 0.125 * step, "eval/pass@8": 0.25})
  w.close()
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  w = MetricsWriter(str(tmp_path), tensorboard=False, start_step=2, wandb=settings, config={"train": {"steps": 3}})
  w.write(3, {"loss": 0.375})
  w.close()
  runs = sorted(glob.glob(f"{tmp_path}/wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
  assert len(runs) == 2                                  # two attempts, one W&B run id
  first, second = (open(p, "rb").read() for p in runs)
  assert b"eval/pass@8" in first and b"0.25" in first and b"0.375" in second
