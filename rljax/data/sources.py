"""Random-access row readers for local files and tfds array_record datasets.

Every reader has `len(reader)`, `reader.read(i) -> dict` and
`reader.where(i) -> str` (file and row position, for error messages). `read`
raises `RowError` for a row that cannot be parsed; the caller decides whether
that skips the row or stops the run.
"""
from __future__ import annotations

import bisect
import glob
import json
import os
from typing import Any, Sequence

import numpy as np

from rljax.errors import ConfigError, DataError

_EXTENSIONS = {"jsonl": (".jsonl",), "json": (".json",), "parquet": (".parquet",)}


class RowError(Exception):
  """One row cannot be parsed or lacks a required field (internal)."""


class RowReader:
  """Interface of a random-access reader of dict rows."""

  def __len__(self) -> int:
    raise NotImplementedError

  def read(self, index: int) -> dict[str, Any]:
    raise NotImplementedError

  def where(self, index: int) -> str:
    raise NotImplementedError


def resolve_files(path: str, formats: Sequence[str], where: str) -> list[tuple[str, str]]:
  """Expands a file, directory or glob into sorted (file, format) pairs.

  A directory is searched recursively for files whose extension matches one of
  `formats`. An explicit single file is read in the first format of `formats`
  that matches its extension, or in `formats[0]` when only one is allowed.
  """
  path = os.path.expanduser(path)
  extensions = {ext: fmt for fmt in formats for ext in _EXTENSIONS[fmt]}

  def fmt_of(file: str) -> str | None:
    for ext, fmt in extensions.items():
      if file.endswith(ext):
        return fmt
    return None

  if os.path.isfile(path):
    fmt = fmt_of(path) or (formats[0] if len(formats) == 1 else None)
    if fmt is None:
      raise DataError(f"{where}: cannot tell the format of '{path}'; name it *.jsonl, *.json or *.parquet, or use "
                      f"kind jsonl/json/parquet.")
    return [(path, fmt)]
  if os.path.isdir(path):
    candidates = [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]
  else:
    candidates = glob.glob(path, recursive=True)
    if not candidates:
      raise DataError(f"{where}: no file matches '{path}'; check the path (relative paths resolve from {os.getcwd()}).")
  out = sorted((f, fmt_of(f)) for f in candidates if os.path.isfile(f) and fmt_of(f))
  if not out:
    raise DataError(f"{where}: '{path}' holds no {'/'.join(sorted(extensions))} files.")
  return out


# Encodings JSONL files must not be in (JSON lines are UTF-8; a UTF-16 file would be split at
# the wrong bytes and read "by accident", losing rows).
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32-LE"), (b"\x00\x00\xfe\xff", "UTF-32-BE"), (b"\xff\xfe", "UTF-16-LE"),
         (b"\xfe\xff", "UTF-16-BE"))
DEFAULT_MAX_LINE_BYTES = 16 << 20


def sniff_encoding(head: bytes) -> str | None:
  """The UTF-16/32 encoding the first bytes of a text file show (a byte-order mark, or the NUL
  bytes of ASCII text in UTF-16/32), or None (UTF-8, or too short to tell)."""
  for bom, name in _BOMS:
    if head.startswith(bom):
      return name + " (byte-order mark)"
  if len(head) >= 4:
    if head[1:4] == b"\0\0\0" and head[0]:
      return "UTF-32-LE"
    if head[:3] == b"\0\0\0" and head[3]:
      return "UTF-32-BE"
    if head[1] == 0 and head[3] == 0 and head[0] and head[2]:
      return "UTF-16-LE"
    if head[0] == 0 and head[2] == 0 and head[1] and head[3]:
      return "UTF-16-BE"
  return None


class JsonlReader(RowReader):
  """One JSON object per non-blank line; lines are parsed lazily on access.

  A line longer than `max_line_bytes` is a malformed row: it is skipped over while the file is
  indexed (never held in memory) and reading it raises RowError. A UTF-16/32 file is refused.
  """

  def __init__(self, file: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, where: str = "data"):
    self._file = file
    self._limit = int(max_line_bytes)
    offsets, lines, long = [], [], {}
    with open(file, "rb") as f:
      encoding = sniff_encoding(f.read(4))
      if encoding is not None:
        raise DataError(f"{where}: '{file}' is {encoding}; JSONL files must be UTF-8. Convert it, e.g. "
                        f"iconv -f {encoding.split()[0]} -t UTF-8 '{file}' > converted.jsonl")
      f.seek(0)
      pos, line_no = 0, 0
      while raw := f.readline(self._limit + 1):
        line_no += 1
        size = len(raw)
        if size > self._limit and not raw.endswith(b"\n"):  # too long: skip to its end unread
          while chunk := f.readline(1 << 16):
            size += len(chunk)
            if chunk.endswith(b"\n"):
              break
          long[len(offsets)] = size
          offsets.append(pos)
          lines.append(line_no)
        elif raw.strip():
          offsets.append(pos)
          lines.append(line_no)
        pos += size
    self._offsets = np.asarray(offsets, np.int64)
    self._lines = np.asarray(lines, np.int64)
    self._long = long
    self._handle = None

  def __len__(self) -> int:
    return len(self._offsets)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_handle"] = None
    return state

  def read(self, index: int) -> dict[str, Any]:
    if index in self._long:
      raise RowError(f"the line has {self._long[index]} bytes, more than data.max_line_bytes={self._limit}; "
                     "shorten it, or raise data.max_line_bytes")
    if self._handle is None:
      self._handle = open(self._file, "rb")
    self._handle.seek(int(self._offsets[index]))
    raw = self._handle.readline(self._limit + 1)
    if len(raw) > self._limit and not raw.endswith(b"\n"):
      raise RowError(f"the line has more than data.max_line_bytes={self._limit} bytes (the file changed since it "
                     "was opened?)")
    try:
      row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RowError(f"invalid JSON ({e})") from None
    if not isinstance(row, dict):
      raise RowError(f"expected a JSON object, got {type(row).__name__}")
    return row

  def where(self, index: int) -> str:
    return f"{self._file} line {int(self._lines[index])}"


class JsonReader(RowReader):
  """A .json file holding one object (the MATH per-problem layout) or a list of objects."""

  def __init__(self, file: str):
    self._file = file
    self._error = None
    try:
      with open(file, "rb") as f:
        data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      # The file still counts as one (malformed) row so the problem is reported.
      self._error, data = f"invalid JSON ({e})", [None]
    self._rows = data if isinstance(data, list) else [data]
    self._is_list = isinstance(data, list) and self._error is None

  def __len__(self) -> int:
    return len(self._rows)

  def read(self, index: int) -> dict[str, Any]:
    if self._error:
      raise RowError(self._error)
    row = self._rows[index]
    if not isinstance(row, dict):
      raise RowError(f"expected a JSON object, got {type(row).__name__}")
    return row

  def where(self, index: int) -> str:
    return f"{self._file} item {index}" if self._is_list else self._file


class ParquetReader(RowReader):
  """Rows of a Parquet file; only the columns the field mapping needs are loaded."""

  def __init__(self, file: str, columns: Sequence[str], where: str):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    self._file = file
    try:
      pf = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises several types for corrupt files.
      raise DataError(f"{where}: cannot read Parquet file '{file}' ({e}).") from e
    available = pf.schema_arrow.names
    missing = [c for c in columns if c not in available]
    if missing:
      raise DataError(f"{where}: Parquet file '{file}' has no column(s) {missing}; available columns are "
                      f"{available}. Fix the source's 'fields' mapping.")
    table = pf.read(columns=list(columns))
    self._columns = {name: table.column(name).to_pylist() for name in columns}
    self._len = table.num_rows

  def __len__(self) -> int:
    return self._len

  def read(self, index: int) -> dict[str, Any]:
    return {name: values[index] for name, values in self._columns.items()}

  def where(self, index: int) -> str:
    return f"{self._file} row {index}"


def _to_python(value: Any) -> Any:
  """Decodes tfds values (bytes, numpy scalars/arrays) into JSON-able Python values."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray):
    if value.dtype.kind in ("S", "O"):
      return [_to_python(v) for v in value.tolist()]
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, dict):
    return {k: _to_python(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_python(v) for v in value]
  return value


class TfdsReader(RowReader):
  """A tfds array_record data source (`tfds.data_source`; no TensorFlow needed)."""

  def __init__(self, *, name: str | None, path: str | None, data_dir: str | None, split: str, where: str):
    try:
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ConfigError(f"{where}: kind 'tfds' needs the tensorflow-datasets package; "
                        "pip install tensorflow-datasets.") from e
    self._label = f"tfds {name or path} split {split!r}"
    try:
      if path is not None:
        self._source = tfds.builder_from_directory(os.path.expanduser(path)).as_data_source(split=split)
      else:
        self._source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # tfds raises many types for a missing/unprepared dataset.
      raise DataError(
          f"{where}: cannot open {self._label} ({type(e).__name__}: {e}). Prepare it in array_record format first "
          "(builder.download_and_prepare(file_format='array_record')) and point 'data_dir' or 'path' at it.") from e

  def __len__(self) -> int:
    return len(self._source)

  def read(self, index: int) -> dict[str, Any]:
    try:
      row = self._source[index]
    except Exception as e:  # A corrupt record surfaces as a decode error of some type.
      raise RowError(f"cannot decode record ({type(e).__name__}: {e})") from None
    row = _to_python(row)
    if not isinstance(row, dict):
      raise RowError(f"expected a feature dict, got {type(row).__name__}")
    return row

  def where(self, index: int) -> str:
    return f"{self._label} record {index}"


class ConcatReader(RowReader):
  """Several readers back to back (the files of a directory or glob, in sorted order)."""

  def __init__(self, readers: Sequence[RowReader]):
    self._readers = list(readers)
    self._starts = np.cumsum([0] + [len(r) for r in self._readers]).tolist()

  def __len__(self) -> int:
    return self._starts[-1]

  def _locate(self, index: int) -> tuple[RowReader, int]:
    i = bisect.bisect_right(self._starts, index) - 1
    return self._readers[i], index - self._starts[i]

  def read(self, index: int) -> dict[str, Any]:
    reader, local = self._locate(index)
    return reader.read(local)

  def where(self, index: int) -> str:
    reader, local = self._locate(index)
    return reader.where(local)


def open_files(path: str, formats: Sequence[str], columns: Sequence[str], where: str,
               max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> RowReader:
  """Opens every file under `path` as one reader, in sorted file order."""
  readers = []
  for file, fmt in resolve_files(path, formats, where):
    if fmt == "jsonl":
      readers.append(JsonlReader(file, max_line_bytes, where))
    elif fmt == "json":
      readers.append(JsonReader(file))
    else:
      readers.append(ParquetReader(file, columns, where))
  return readers[0] if len(readers) == 1 else ConcatReader(readers)
