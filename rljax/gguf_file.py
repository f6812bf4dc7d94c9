"""Reading GGUF files (llama.cpp's format): the header's key-value metadata, and the tensors.

One reader for every use: the tokenizer (`tokenizer.*` entries), the model loader
(rljax/models/gguf_io.py: the architecture's entries, then the tensors) and the config's
context check (`<arch>.context_length` only, before any weights load).

`read_metadata` parses the header itself over a memory map (no `gguf` package needed; SmolLM2's
header with its 49k-token vocabulary takes ~0.14 s, gguf.GGUFReader ~0.7 s) and can stop as
soon as it has what it needs. Tensors are read with the `gguf` package (`tensor_reader`), which
memory-maps them and dequantizes one at a time; `plain_reader_class` is the reader
rljax uses.

Errors are `GGUFFormatError` (a ValueError) without the path; each caller names the file in
its own error type (TokenizerError, WeightsError).
"""
from __future__ import annotations

import mmap
import struct
from typing import Any, Callable

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_CONTEXT_LENGTH = 2048   # the loader's context when a file has no `<arch>.context_length`

# GGUF value types: scalars by struct format; 8 is a string (u64 length + UTF-8 bytes), 9 an array
# (element type u32, count u64, elements).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
  """Not a GGUF file, an unsupported version, or a cut or corrupt header (the message says which)."""


class _Header:
  """A cursor over the mapped bytes of a GGUF file, in its byte order."""

  def __init__(self, data, order: str):
    self.data, self.order, self.pos = data, order, 0

  def scalar(self, fmt: str):
    value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
    self.pos += struct.calcsize(fmt)
    return value

  def string(self, keep: bool = True) -> str | None:
    n = self.scalar("Q")
    if self.pos + n > len(self.data):
      raise GGUFFormatError(f"a string of {n} bytes at offset {self.pos} runs past the end of the file")
    start, self.pos = self.pos, self.pos + n
    return bytes(self.data[start:self.pos]).decode("utf-8", errors="replace") if keep else None

  def value(self, kind: int, keep: bool = True) -> Any:
    if kind in _SCALARS:
      return self.scalar(_SCALARS[kind])
    if kind == _STRING:
      return self.string(keep)
    if kind != _ARRAY:
      raise GGUFFormatError(f"unknown value type {kind} at offset {self.pos}")
    elem, count = self.scalar("I"), self.scalar("Q")
    if elem in _SCALARS:
      dtype = np.dtype(self.order + _SCALARS[elem])
      if self.pos + count * dtype.itemsize > len(self.data):
        raise GGUFFormatError(f"an array of {count} values at offset {self.pos} runs past the end of the file")
      values = np.frombuffer(self.data, dtype, count, self.pos).tolist() if keep else None
      self.pos += count * dtype.itemsize
      return values
    if count * 8 > len(self.data) - self.pos:   # every string or array element takes at least 8 bytes
      raise GGUFFormatError(f"an array of {count} values at offset {self.pos} runs past the end of the file")
    values = [self.value(elem, keep) for _ in range(count)]
    return values if keep else None


def read_metadata(path: str, *, keep: Callable[[str], bool] | None = None,
                  stop: Callable[[dict], bool] | None = None) -> dict[str, Any]:
  """The header's key-value entries of the GGUF file at `path`, as Python values (ints, floats,
  bools, strings, lists; strings decoded leniently, invalid UTF-8 -> U+FFFD). Tensors are not read.

  keep: which keys to return (None: all; the others are skipped, not decoded). stop: called with
  the entries read so far after each one; True ends the read there.

  Raises:
    OSError: the file cannot be read.
    GGUFFormatError: not a GGUF file, a version other than 2 or 3, or a cut or corrupt header.
  """
  with open(path, "rb") as f:
    head = f.read(8)
    if head[:4] != MAGIC:
      raise GGUFFormatError(f"not a GGUF file (bad magic {head[:4]!r})")
    if len(head) < 8:
      raise GGUFFormatError(f"corrupt or truncated GGUF header (the file ends after {len(head)} bytes)")
    version = int.from_bytes(head[4:8], "little")
    order = "<"
    if version >= 0x10000:   # a big-endian file
      version, order = int.from_bytes(head[4:8], "big"), ">"
    if version not in VERSIONS:
      raise GGUFFormatError(f"GGUF version {version} is not supported (need 2 or 3)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      cursor = _Header(data, order)
      cursor.pos = 8
      out: dict[str, Any] = {}
      try:
        cursor.scalar("Q")   # tensor count
        entries = cursor.scalar("Q")
        for _ in range(entries):
          key = cursor.string()
          wanted = keep is None or keep(key)
          value = cursor.value(cursor.scalar("I"), wanted)
          if wanted:
            out[key] = value
          if stop is not None and stop(out):
            break
      except GGUFFormatError as e:
        raise GGUFFormatError(f"corrupt or truncated GGUF header ({e})") from None
      except struct.error:
        raise GGUFFormatError(f"corrupt or truncated GGUF header (the file ends at byte {len(data)}, inside the "
                              f"value at offset {cursor.pos})") from None
      except (ValueError, MemoryError, OverflowError) as e:
        raise GGUFFormatError(f"corrupt or truncated GGUF header ({type(e).__name__}: {e} at offset "
                              f"{cursor.pos})") from None
  return out


def context_length(path: str) -> int | None:
  """`<general.architecture>.context_length` of a GGUF file, reading the header only up to it
  (DEFAULT_CONTEXT_LENGTH when the entry is absent, None when the file names no architecture)."""

  def found(meta):
    arch = meta.get("general.architecture")
    return arch is not None and f"{arch}.context_length" in meta

  meta = read_metadata(path, keep=lambda k: k == "general.architecture" or k.endswith(".context_length"),
                       stop=found)
  arch = meta.get("general.architecture")
  if arch is None:
    return None
  return int(meta.get(f"{arch}.context_length", DEFAULT_CONTEXT_LENGTH))


def plain_reader_class():
  """`gguf.GGUFReader` over a plain ndarray view of the memory map, for the tensors.

  The reader slices its buffer once per metadata value (~250k times for a 49k-token vocabulary);
  on an np.memmap each slice pays the subclass's bookkeeping, which makes opening SmolLM2 take
  several times longer. The view shares the mapped buffer, so tensors are still read lazily from
  disk. The `gguf` package is an optional dependency, imported here when tensors are read.
  """
  from gguf import GGUFReader  # pylint: disable=import-outside-toplevel

  class PlainReader(GGUFReader):
    @property
    def data(self):
      return self._plain_data

    @data.setter
    def data(self, value):
      self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

  return PlainReader
