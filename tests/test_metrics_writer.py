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
