"""What travels between the reward pool and its processes, and how it is framed.

Requests (pool -> worker) are pickled: they come from the trainer, which the worker trusts.
Everything a worker or the zygote sends back is plain data, JSON-encoded, in frames of at
most MAX_REPLY bytes: decoding a reply runs no code of the sender's (unpickling could), and
`Inbox` decodes within a time budget per call, so a flood of replies cannot hold `score`
past its deadline.

Frame: the payload's length (8 bytes, big-endian), then the payload.

Replies (worker -> pool), one per task, in order:
  {"t": task_id, "r": [[score, info or null], ...]}     scored (score null, info {"error": ...}: an ItemFailure)
  {"t": task_id, "e": "message"}                        the verifier failed
  optional keys: "x": why the worker must be replaced after this task (it changed its process
  state, see procstate.py); "d": ["info['k'] is a function, not plain data", ...] (values dropped)
Notes (worker -> pool), any number before a task's reply:
  {"n": "import", "t": task_id, "m": "sympy"}           the verifier started importing a module
"""
from __future__ import annotations

import json
import math
import numbers
import pickle
import socket
import struct
import time
from typing import Any

import numpy as np

HEADER = struct.Struct("!Q")
MAX_REQUEST = 1 << 30     # a longer request frame is a corrupted stream
MAX_REPLY = 8 << 20       # a reply above this loses its info dicts; a frame above it is corruption
MAX_DEPTH = 16            # info nesting kept (deeper values are dropped)
MAX_ITEMS = 100_000       # list/dict entries kept per info dict (the rest are dropped)
DECODE_BUDGET_S = 0.05    # decoding time per Inbox.decode call (at least one frame is decoded)
_DROPPED_NOTES = 5        # drop messages kept per reply


# ---- framing ----------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
  return HEADER.pack(len(payload)) + payload


def encode_request(obj: Any) -> bytes:
  return frame(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def split_frames(buf: bytearray, max_size: int) -> tuple[list[bytes], str | None]:
  """Removes every complete frame from the front of `buf`: their payloads, and why the stream
  is corrupt (None while it is not): a header announcing more than max_size bytes."""
  out = []
  while len(buf) >= HEADER.size:
    (n,) = HEADER.unpack_from(buf)
    if n > max_size:
      return out, f"a frame of {n} bytes announced"
    end = HEADER.size + n
    if len(buf) < end:
      break
    out.append(bytes(buf[HEADER.size:end]))
    del buf[:end]
  return out, None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  chunks, left = [], n
  while left:
    chunk = sock.recv(min(left, 1 << 20))
    if not chunk:
      raise EOFError
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def recv_request(sock: socket.socket) -> Any:
  """Blocking read of one request frame (the worker's side)."""
  (n,) = HEADER.unpack(_recv_exact(sock, HEADER.size))
  if n > MAX_REQUEST:
    raise EOFError(f"frame of {n} bytes announced")
  return pickle.loads(_recv_exact(sock, n))


# ---- plain data -------------------------------------------------------------------------------


def _kind(value: Any) -> str:
  if callable(value):
    return "a function" if hasattr(value, "__code__") else f"a callable {type(value).__name__}"
  return f"a {type(value).__name__}"


_SIMPLE = frozenset((str, int, float, bool, type(None)))


def plain(value: Any, where: str, dropped: list[str], depth: int = 0) -> Any:
  """`value` as JSON-able plain data: None, bool, int, float, str, and lists and string-keyed
  dicts of them. numpy scalars and arrays are converted; anything else is left out and named in
  `dropped`. Returns _DROP for a value left out."""
  if type(value) is dict and all(type(k) is str and type(v) in _SIMPLE for k, v in value.items()):
    return value  # the common flat info dict: nothing to convert
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, float):
    return value
  if isinstance(value, numbers.Real):  # Fraction, Decimal, ...: averaged as floats in the metrics
    try:
      return float(value)
    except (TypeError, ValueError, OverflowError):
      pass
  if isinstance(value, np.generic) and value.dtype.kind in "biuf":
    return value.item()
  if depth >= MAX_DEPTH:
    dropped.append(f"{where} is nested more than {MAX_DEPTH} levels deep")
    return _DROP
  if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
    if value.size > MAX_ITEMS:
      dropped.append(f"{where} is an array of {value.size} values (at most {MAX_ITEMS})")
      return _DROP
    return value.tolist()
  if isinstance(value, (list, tuple)):
    if len(value) > MAX_ITEMS:
      dropped.append(f"{where} has {len(value)} entries (at most {MAX_ITEMS})")
      return _DROP
    out = []
    for i, v in enumerate(value):
      v = plain(v, f"{where}[{i}]", dropped, depth + 1)
      if v is not _DROP:
        out.append(v)
    return out
  if isinstance(value, dict):
    if len(value) > MAX_ITEMS:
      dropped.append(f"{where} has {len(value)} entries (at most {MAX_ITEMS})")
      return _DROP
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        dropped.append(f"{where} has a key {k!r} that is not a string")
        continue
      v = plain(v, f"{where}[{k!r}]", dropped, depth + 1)
      if v is not _DROP:
        out[k] = v
    return out
  dropped.append(f"{where} is {_kind(value)}, not plain data (str, number, bool, None, lists and dicts of them)")
  return _DROP


_DROP = object()


# ensure_ascii: lone surrogates (from decoded model text) survive as \\udXXXX escapes. One encoder
# object: json.dumps with options would build a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True, ensure_ascii=True)


def _dumps(obj: Any) -> bytes:
  return _ENCODER.encode(obj).encode("ascii")


def encode_reply(task_id: int, results: list[tuple[float, dict | None]] | None = None, error: str | None = None,
                 recycle: str | None = None) -> bytes:
  """A worker's reply frame: info values that are not plain data are dropped (and named); when
  the reply would exceed MAX_REPLY, every info dict is dropped."""
  msg: dict[str, Any] = {"t": int(task_id)}
  dropped: list[str] = []
  if error is not None:
    msg["e"] = str(error)[:2000]
  else:
    rows = []
    for score, info in results or ():
      if info is not None:
        info = plain(info, "info", dropped)
        info = None if info is _DROP else info
      rows.append([None if score is None else float(score), info])   # None: an ItemFailure
    msg["r"] = rows
  if recycle:
    msg["x"] = recycle
  if dropped:
    msg["d"] = dropped[:_DROPPED_NOTES] + ([f"and {len(dropped) - _DROPPED_NOTES} more"]
                                           if len(dropped) > _DROPPED_NOTES else [])
  data = _dumps(msg)
  if len(data) + HEADER.size > MAX_REPLY and "r" in msg:
    msg["r"] = [[s, None] for s, _ in msg["r"]]
    msg["d"] = [f"the reply was {len(data)} bytes (at most {MAX_REPLY}): every info dict was dropped"]
    data = _dumps(msg)
  if len(data) + HEADER.size > MAX_REPLY:  # an error message cannot be this long; be safe anyway
    data = _dumps({"t": int(task_id), "e": "reply too large", **({"x": recycle} if recycle else {})})
  return frame(data)


def encode_note(task_id: int, kind: str, **fields: Any) -> bytes:
  return frame(_dumps({"n": kind, "t": int(task_id), **fields}))


def encode_control(obj: Any) -> bytes:
  """A zygote <-> pool control message (one SOCK_SEQPACKET datagram, no frame header)."""
  return _dumps(obj)


def decode_control(data: bytes) -> Any:
  return _DECODER.decode(data.decode("ascii"))


_DECODER = json.JSONDecoder()


# ---- decoding on the pool's side ----------------------------------------------------------------


class Inbox:
  """Reassembles and decodes one worker's frames: `feed` bytes as they come, `decode` returns the
  decoded messages within a time budget (frames left over stay queued for the next call)."""

  def __init__(self):
    self.buf = bytearray()
    self.frames: list[bytes] = []
    self.corrupt: str | None = None

  def feed(self, data: bytes) -> None:
    self.buf += data
    frames, corrupt = split_frames(self.buf, MAX_REPLY)
    self.frames.extend(frames)
    self.corrupt = self.corrupt or corrupt

  @property
  def pending(self) -> bool:
    return bool(self.frames)

  def decode(self, budget_s: float = DECODE_BUDGET_S) -> tuple[list[dict], str | None]:
    """(messages, why the stream is corrupt or None). Never raises."""
    out, stop = [], time.monotonic() + budget_s
    while self.frames:
      data = self.frames.pop(0)
      try:
        msg = _DECODER.decode(data.decode("ascii"))
      except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return out, f"corrupt frame ({type(e).__name__})"
      if not isinstance(msg, dict) or not isinstance(msg.get("t"), int):
        return out, "corrupt frame (not a reply)"
      out.append(msg)
      if time.monotonic() > stop:
        break
    return out, (self.corrupt if not self.frames else None)


def reply_results(msg: dict, n: int) -> tuple[list[tuple[float, dict | None]] | None, str | None]:
  """(results, None) from a decoded "r" reply of n items, or (None, why it is malformed)."""
  rows = msg.get("r")
  if not isinstance(rows, list) or len(rows) != n:
    return None, f"malformed reply: expected {n} results"
  out = []
  for row in rows:
    if isinstance(row, list) and len(row) == 2 and row[0] is None and isinstance(row[1], dict) and \
        isinstance(row[1].get("error"), str):
      out.append((None, row[1]))     # an item the verifier could not score (base.ItemFailure)
      continue
    if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], (int, float))
            and not isinstance(row[0], bool) and (row[1] is None or isinstance(row[1], dict))):
      return None, "malformed reply: expected (score, info) pairs"
    score = float(row[0])
    if not math.isfinite(score):
      return None, f"score {score} is not finite in float32"
    out.append((score, row[1]))
  return out, None
