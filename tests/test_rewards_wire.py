"""What workers send back (rljax/rewards/wire.py): plain data only, a size bound, decoding within a
time budget. The pool tests (test_rewards_hostile.py) run the same paths through real workers."""
import fractions
import json

import numpy as np

from rljax.rewards import wire


def _decode(frame: bytes) -> dict:
  inbox = wire.Inbox()
  inbox.feed(frame)
  messages, corrupt = inbox.decode()
  assert corrupt is None and len(messages) == 1
  return messages[0]


def test_info_values_become_plain_data_or_are_dropped_by_name():
  info = {"n": np.int64(3), "x": np.float32(0.5), "flag": np.bool_(True), "frac": fractions.Fraction(1, 4),
          "arr": np.arange(3), "nested": {"ok": [1, "a", None], 5: "int key"}, "fn": len, "obj": object(),
          "nan": float("nan")}
  msg = _decode(wire.encode_reply(7, [(1.0, info)]))
  got = msg["r"][0][1]
  assert got["n"] == 3 and got["x"] == 0.5 and got["flag"] is True and got["frac"] == 0.25
  assert got["arr"] == [0, 1, 2] and got["nested"] == {"ok": [1, "a", None]} and got["nan"] != got["nan"]
  assert "fn" not in got and "obj" not in got
  dropped = " | ".join(msg["d"])
  assert "info['fn'] is a callable builtin_function_or_method" in dropped and "info['obj'] is a object" in dropped
  assert "key 5 that is not a string" in dropped


def test_oversized_reply_keeps_scores_and_drops_infos():
  big = {"blob": "x" * (wire.MAX_REPLY + 10)}
  frame = wire.encode_reply(1, [(0.5, big), (1.0, {"small": 1})])
  assert len(frame) < wire.MAX_REPLY
  msg = _decode(frame)
  assert msg["r"] == [[0.5, None], [1.0, None]] and "every info dict was dropped" in msg["d"][0]


def test_decoding_stops_at_its_time_budget_and_resumes():
  inbox = wire.Inbox()
  inbox.feed(b"".join(wire.encode_note(i, "import", m="x") for i in range(5000)))
  first, corrupt = inbox.decode(budget_s=0.0)  # at least one message per call, then the budget
  assert corrupt is None and len(first) == 1 and inbox.pending
  rest, _ = inbox.decode(budget_s=10.0)
  assert len(first) + len(rest) == 5000 and not inbox.pending


def test_corrupt_and_oversized_frames_are_reported_not_raised():
  inbox = wire.Inbox()
  inbox.feed(wire.frame(b"\x80not json"))
  assert inbox.decode()[1].startswith("corrupt frame")
  inbox = wire.Inbox()
  inbox.feed(wire.HEADER.pack(wire.MAX_REPLY + 1) + b"x")
  assert inbox.decode()[1] == f"a frame of {wire.MAX_REPLY + 1} bytes announced"
  inbox = wire.Inbox()
  inbox.feed(wire.frame(json.dumps([1, 2]).encode()))
  assert inbox.decode()[1] == "corrupt frame (not a reply)"


def test_reply_results_checks_shape_and_scores():
  assert wire.reply_results({"t": 1, "r": [[1.0, None]]}, 1) == ([(1.0, None)], None)
  assert wire.reply_results({"t": 1, "r": [[1.0, None]]}, 2)[1] == "malformed reply: expected 2 results"
  assert wire.reply_results({"t": 1, "r": [["1", None]]}, 1)[1] == "malformed reply: expected (score, info) pairs"
  assert "not finite" in wire.reply_results({"t": 1, "r": [[float("inf"), None]]}, 1)[1]
