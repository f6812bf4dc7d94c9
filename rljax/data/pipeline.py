"""build_dataset: sources -> examples -> shuffle/epochs -> weighted mixture -> process shard.

The pipeline is a chain of grain `MapDataset`s, i.e. random access by index
all the way down. A position in the final stream therefore determines the
example completely, which is what makes the batch iterator's state a single
integer (see `batching.PromptBatcher`).

Order of operations, per source:
  1. rows are read lazily and mapped to Examples (or `Malformed` markers);
  2. `num_examples` keeps the first N rows (before shuffling);
  3. finite sources are shuffled with a seed derived from (seed, source
     position) and repeated `num_epochs` times, reshuffled every epoch;
     unbounded procedural sources are neither shuffled nor repeated.
Then the sources are interleaved by `grain.MapDataset.mix` in proportion to
their weights (a deterministic interleave: any window of the stream holds each
source in proportion to its weight, up to rounding), which stops when any
source runs out. Finally process p of n keeps stream positions p, p+n, p+2n...
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Iterator

import grain

from rljax.data import procedural
from rljax.data.config import FILE_KINDS, PROCEDURAL_KINDS, normalize_config
from rljax.data.formats import Example, row_to_example
from rljax.data.sources import DEFAULT_MAX_LINE_BYTES, RowError, RowReader, TfdsReader, open_files
from rljax.errors import ConfigError, DataError

_FILE_FORMATS = {"jsonl": ("jsonl",), "json": ("json",), "parquet": ("parquet",)}
_ANY_FORMAT = ("jsonl", "parquet", "json")


@dataclasses.dataclass(frozen=True)
class Malformed:
  """Marks a row that could not be turned into an Example (on_malformed='skip')."""
  source: str
  where: str
  reason: str


def derive_seed(*parts: Any) -> int:
  """A 31-bit seed from any tuple of values, stable across runs and platforms."""
  digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


class ExampleSource:
  """Random access to one source's Examples (grain `MapDataset.source` input)."""

  def __init__(self, reader: RowReader, src: dict[str, Any], top: dict[str, Any], split: str, where: str):
    self._reader = reader
    self._src = src
    self._top = top
    self._split = split
    self._where = where
    self._length = len(reader) if src["num_examples"] is None else min(len(reader), src["num_examples"])

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> Example | Malformed:
    try:
      row = self._reader.read(index)
      return row_to_example(row, self._src, self._top, row_index=index, split=self._split)
    except RowError as e:
      where = self._reader.where(index)
      if self._top["on_malformed"] == "raise":
        raise DataError(
            f"{where}: malformed row in {self._where} (source '{self._src['label']}'): {e}. "
            "Fix or remove the row, correct the source's 'fields' mapping, or set data.on_malformed: skip "
            "to skip and count such rows.") from None
      return Malformed(self._src["label"], where, str(e))


def _split_value(value: Any, split: str, where: str) -> Any:
  """Resolves a per-split mapping ({train: a, test: b}) to the value for `split`."""
  if isinstance(value, dict):
    if split not in value:
      raise ConfigError(f"{where}: no entry for split '{split}' (has {sorted(value)}); add one.")
    return value[split]
  return value


def _columns(fields: dict[str, Any]) -> list[str]:
  cols = [fields["prompt"], fields["answer"], fields["id"], *fields["extra"].values()]
  return list(dict.fromkeys(c for c in cols if c is not None))


def open_source(src: dict[str, Any], top: dict[str, Any], index: int, split: str) -> ExampleSource:
  """The reader for one normalized source config, wrapped to produce Examples."""
  where = f"data.sources[{index}]"
  kind = src["kind"]
  if kind in PROCEDURAL_KINDS:
    reader = procedural.make_task(kind, seed=src["seed"], difficulty=src["difficulty"], split=split,
                                  num_examples=src["num_examples"], held_out_fraction=src["held_out_fraction"])
  elif kind in FILE_KINDS:
    path = _split_value(src["path"], split, f"{where}.path")
    reader = open_files(path, _FILE_FORMATS.get(kind, _ANY_FORMAT), _columns(src["fields"]), where,
                        top["max_line_bytes"])
  else:
    tfds_split = _split_value(src["split"], split, f"{where}.split") or split
    reader = TfdsReader(name=src["name"], path=src["path"], data_dir=src["data_dir"], split=tfds_split, where=where)
  if len(reader) == 0:
    raise DataError(f"{where} (source '{src['label']}'): no rows for split '{split}'; check the path or split.")
  source = ExampleSource(reader, src, top, split, where)
  if kind not in PROCEDURAL_KINDS:
    _check_has_valid_example(reader, source, src, top, split, where)
  return source


# Errors quoted when a source has no valid example.
_PROBE_ERRORS = 3


def _check_has_valid_example(reader: RowReader, source: ExampleSource, src: dict[str, Any], top: dict[str, Any],
                             split: str, where: str) -> None:
  """Reads rows until the first valid example; a source with none is a DataError naming the file
  and its first errors. Without this, on_malformed='skip' over a repeating stream of bad rows
  would skip forever (each skip logged once, then silence)."""
  errors = []
  for index in range(len(source)):
    try:
      row_to_example(reader.read(index), src, top, row_index=index, split=split)
      return
    except RowError as e:
      if len(errors) < _PROBE_ERRORS:
        errors.append(f"{reader.where(index)}: {e}")
  fields = src["fields"]
  mapping = f"prompt <- '{fields['prompt']}'" + (f", answer <- '{fields['answer']}'" if fields["answer"] else "")
  raise DataError(
      f"{where} (source '{src['label']}', split '{split}'): none of its {len(source)} rows is a valid example; "
      f"the first errors: {'; '.join(errors)}. Fix the file, or map its columns with the source's 'fields' "
      f"(now {mapping}), e.g. fields={{'prompt': 'question', 'answer': 'answer'}}.")


# Streams at least this long (unbounded procedural tasks, repeat-forever
# datasets, any shard of them) count as endless; real datasets are far smaller.
_ENDLESS = 2**48


def _is_unbounded(length: int) -> bool:
  return length >= _ENDLESS


class PromptDataset:
  """The examples of one process, in order: `ds[i]` is an Example or `Malformed`.

  Attributes:
    config: the normalized data config (every field present).
    split, process_index, process_count: as passed to `build_dataset`.
    fingerprint: a hash of all of the above; a saved iterator state is only
      valid for a dataset with the same fingerprint.
  """

  def __init__(self, mapds, config: dict[str, Any], split: str,
               process_index: int, process_count: int, sources: list[ExampleSource], shard_block: int = 1):
    self.mapds = mapds
    self.config = config
    self.split = split
    self.process_index = process_index
    self.process_count = process_count
    self.sources = sources
    # Defaults of fields added later are left out, so that states saved before them stay valid.
    hashed = {k: v for k, v in config.items() if not (k == "max_line_bytes" and v == DEFAULT_MAX_LINE_BYTES)}
    blob = json.dumps([hashed, split, process_index, process_count] + ([shard_block] if shard_block > 1 else []),
                      sort_keys=True, default=str)
    self.fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]

  def __len__(self) -> int:
    return len(self.mapds)

  @property
  def is_finite(self) -> bool:
    return not _is_unbounded(len(self.mapds))

  def __getitem__(self, index: int) -> Example | Malformed:
    return self.mapds[index]

  def __iter__(self) -> Iterator[Example]:
    """Valid examples in order, skipping malformed rows (no tokenizer filtering)."""
    index = 0
    while index < len(self.mapds):
      item = self.mapds[index]
      index += 1
      if not isinstance(item, Malformed):
        yield item


class _BlockShard:
  """Process `index` of `count`'s share of a stream dealt out in blocks of `block` examples.

  Global example g goes to process (g // block) % count. With block = the per-process batch
  size, the processes' batches of one step, laid side by side, are the single-process batch.
  """

  def __init__(self, parent, index: int, count: int, block: int):
    self.parent, self.index, self.count, self.block = parent, index, count, block

  def __len__(self) -> int:
    cycle = self.block * self.count
    full, rest = divmod(len(self.parent), cycle)
    return full * self.block + min(max(rest - self.index * self.block, 0), self.block)

  def __getitem__(self, i: int):
    if not 0 <= i < len(self):
      raise IndexError(i)
    cycle, within = divmod(i, self.block)
    return self.parent[cycle * self.block * self.count + self.index * self.block + within]


def build_dataset(cfg: Any, *, split: str = "train", process_index: int = 0, process_count: int = 1,
                  shard_block: int = 1) -> PromptDataset:
  """Builds the example stream of process `process_index` of `process_count`.

  Args:
    cfg: the data config, a dict or ml_collections ConfigDict (see docs/data.md).
    split: "train" or another split name; file sources may map split -> path,
      tfds sources split -> tfds split, and procedural sources switch to their
      held-out stream for any split other than "train".
    process_index, process_count: this process's shard (`jax.process_index()`,
      `jax.process_count()`).
    shard_block: the stream is dealt to processes in blocks of this many examples
      (1: round robin). The trainer passes its per-process batch size, so that a
      multi-process step sees the same global batch as a single-process one.

  Raises:
    ConfigError: an unknown or invalid config field.
    DataError: a missing file, or (with on_malformed='raise') a malformed row.
  """
  if not isinstance(split, str) or not split:
    raise ConfigError(f"build_dataset(split={split!r}): expected a split name such as 'train' or 'test'.")
  if not (isinstance(process_count, int) and process_count >= 1 and isinstance(process_index, int)
          and 0 <= process_index < process_count):
    raise ConfigError(f"build_dataset(process_index={process_index}, process_count={process_count}): "
                      "need 0 <= process_index < process_count.")
  config = normalize_config(cfg)
  sources = [open_source(src, config, i, split) for i, src in enumerate(config["sources"])]

  parts = []
  for i, (src, source) in enumerate(zip(config["sources"], sources)):
    ds = grain.MapDataset.source(source)
    if not _is_unbounded(len(source)):
      if config["shuffle"]:
        ds = ds.shuffle(seed=derive_seed(config["seed"], i, src["label"], split))
      if config["num_epochs"] != 1:
        ds = ds.repeat(config["num_epochs"])
    parts.append(ds)

  if len(parts) == 1:
    mixed = parts[0]
  else:
    mixed = grain.MapDataset.mix(parts, [src["weight"] for src in config["sources"]])
  if not isinstance(shard_block, int) or shard_block < 1:
    raise ConfigError(f"build_dataset(shard_block={shard_block!r}): expected an integer >= 1.")
  if process_count > 1:
    mixed = _BlockShard(mixed, process_index, process_count, shard_block)
  if len(mixed) == 0:
    raise DataError(f"data: process {process_index} of {process_count} gets no examples for split '{split}'; "
                    "the sources are smaller than the number of processes.")
  return PromptDataset(mixed, config, split, process_index, process_count, sources, shard_block)
