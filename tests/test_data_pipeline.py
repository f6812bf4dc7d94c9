"""Pipeline and batcher: padding, filtering, shuffling, epochs, mixtures, sharding, checkpointable state."""
import collections
import json

import numpy as np
import pytest

from rljax.data import PromptBatcher, batching, build_dataset
from rljax.errors import ConfigError, DataError


class FakeByteTokenizer:
  """Test double for the tokenizer duck type: one token per UTF-8 byte, ids offset by 3.

  Its chat template is a fixed, easy-to-count format; the real tokenizer's
  parity is tested elsewhere.
  """
  pad_id = 0

  def encode(self, text, add_special_tokens=False):
    assert add_special_tokens is False
    return [b + 3 for b in text.encode("utf-8")]

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
    assert add_generation_prompt and not tokenize
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def _qa_file(tmp_path, n, name="qa.jsonl"):
  return _write_jsonl(tmp_path / name, [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)])


def _ids(batches):
  return [[e["id"] for e in b.examples] for b in batches]


@pytest.mark.parametrize("buckets, width", [("multiple", 48), ("pow2", 64)])
def test_batch_is_left_padded_to_its_bucket(buckets, width):
  """The longest prompt here has 33-48 tokens: a multiple of 16 gives 48, the default power-of-two
  buckets (16 x 2^k: a handful of compiled programs per run) give 64."""
  cfg = {"sources": [{"kind": "arithmetic", "difficulty": 1}], "system_prompt": "Be brief.", "pad_buckets": buckets}
  batch = next(PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 4))
  assert batch.prompt_ids.dtype == np.int32 and batch.prompt_mask.dtype == bool
  assert batch.prompt_ids.shape == (4, width) and len(batch.examples) == 4
  tok = FakeByteTokenizer()
  for row, ex in enumerate(batch.examples):
    assert ex["prompt_text"] == f"<system>Be brief.<user>{ex['prompt']}<assistant>"
    ids = tok.encode(ex["prompt_text"])
    assert batch.prompt_ids[row, -len(ids):].tolist() == ids
    assert not batch.prompt_mask[row, :-len(ids)].any() and batch.prompt_mask[row, -len(ids):].all()
    assert (batch.prompt_ids[row, :-len(ids)] == FakeByteTokenizer.pad_id).all()
  assert batch.prompt_lengths.tolist() == [len(tok.encode(e["prompt_text"])) for e in batch.examples]


def test_pad_to_max_prompt_tokens_and_no_chat_template():
  cfg = {"sources": [{"kind": "arithmetic"}], "max_prompt_tokens": 100, "pad_to_max_prompt_tokens": True,
         "chat_template": False, "system_prompt": "S"}
  batch = next(PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 2))
  assert batch.prompt_ids.shape == (2, 100)
  assert batch.examples[0]["prompt_text"] == "S\n\n" + batch.examples[0]["prompt"]


def test_over_long_prompts_are_filtered_and_counted(tmp_path):
  rows = [{"prompt": "x" * (5 if i % 3 else 50), "answer": "1"} for i in range(30)]
  cfg = {"sources": [{"kind": "jsonl", "path": _write_jsonl(tmp_path / "d.jsonl", rows), "verifier": "x"}],
         "chat_template": False, "max_prompt_tokens": 20, "num_epochs": 1}
  batcher = PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 4)
  batches = list(batcher)
  assert len(batches) == 5 and all(b.prompt_ids.shape == (4, 16) for b in batches)
  stats = batcher.stats()
  assert stats["filtered_too_long"] == 10 and stats["examples"] == 20 and stats["rows_read"] == 30
  assert stats["filtered_too_long/jsonl"] == 10


def test_malformed_rows_are_counted_by_the_batcher(tmp_path):
  rows = [{"prompt": "ok", "answer": "1"}, "{bad", {"answer": "2"}, {"prompt": "fine", "answer": "3"}]
  cfg = {"sources": [{"kind": "jsonl", "path": _write_jsonl(tmp_path / "d.jsonl", rows), "verifier": "x"}],
         "num_epochs": 1, "shuffle": False}
  batcher = PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 2)
  (batch,) = list(batcher)
  assert [e["answer"] for e in batch.examples] == ["1", "3"]
  assert batcher.stats()["malformed"] == 2


def test_endless_unusable_stream_raises(monkeypatch):
  monkeypatch.setattr(batching, "_MAX_CONSECUTIVE_SKIPS", 50)
  cfg = {"sources": [{"kind": "arithmetic"}], "max_prompt_tokens": 3}
  with pytest.raises(DataError, match="50 consecutive rows"):
    next(PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 2))


def test_remainder_dropped_or_kept(tmp_path):
  cfg = {"sources": [{"kind": "jsonl", "path": _qa_file(tmp_path, 10), "verifier": "x"}], "num_epochs": 1}
  assert [len(b.examples) for b in PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 4)] == [4, 4]
  kept = PromptBatcher(build_dataset(cfg), FakeByteTokenizer(), 4, drop_remainder=False)
  assert [len(b.examples) for b in kept] == [4, 4, 2]


def test_seeded_shuffle_and_epochs(tmp_path):
  path = _qa_file(tmp_path, 20)

  def order(seed, epochs=3):
    cfg = {"sources": [{"kind": "jsonl", "path": path, "verifier": "x"}], "seed": seed, "num_epochs": epochs}
    return [e["prompt"] for e in build_dataset(cfg)]

  a = order(0)
  assert a == order(0) and a != order(1)
  assert len(a) == 60 and collections.Counter(a) == {f"q{i}": 3 for i in range(20)}
  epochs = [a[i * 20:(i + 1) * 20] for i in range(3)]
  assert all(sorted(e) == sorted(f"q{i}" for i in range(20)) for e in epochs)  # each epoch is a full pass
  assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
  assert epochs[0] != sorted(epochs[0], key=lambda p: int(p[1:]))
  unshuffled = {"sources": [{"kind": "jsonl", "path": path, "verifier": "x"}], "shuffle": False, "num_epochs": 1}
  assert [e["prompt"] for e in build_dataset(unshuffled)] == [f"q{i}" for i in range(20)]
  forever = {"sources": [{"kind": "jsonl", "path": path, "verifier": "x"}]}
  assert not build_dataset(forever).is_finite


def test_mixture_proportions_match_weights(tmp_path):
  # Tolerance: grain's mixture interleaves deterministically, so over any N
  # examples each source's share is within (number of sources) / N of its weight.
  cfg = {"sources": [
      {"kind": "arithmetic", "weight": 0.5},
      {"kind": "countdown", "weight": 0.3, "verifier": "cd"},
      {"kind": "jsonl", "path": _qa_file(tmp_path, 50), "verifier": "exact", "weight": 0.2},
  ]}
  ds = build_dataset(cfg)
  for n in (100, 1000, 5000):
    counts = collections.Counter(ds[i]["source"] for i in range(n))
    for label, weight in (("arithmetic", 0.5), ("countdown", 0.3), ("jsonl", 0.2)):
      assert abs(counts[label] / n - weight) <= 3 / n, (n, counts)
  # Each example is routed to its own source's verifier.
  assert {(ds[i]["source"], ds[i]["verifier"]) for i in range(100)} == {
      ("arithmetic", "arithmetic"), ("countdown", "cd"), ("jsonl", "exact")}
  # Per batch as well: a batch of 10 holds 5/3/2.
  batch = next(PromptBatcher(ds, FakeByteTokenizer(), 10))
  assert collections.Counter(e["source"] for e in batch.examples) == {"arithmetic": 5, "countdown": 3, "jsonl": 2}


def test_finite_mixture_stops_when_a_source_runs_out(tmp_path):
  cfg = {"sources": [
      {"kind": "jsonl", "path": _qa_file(tmp_path, 10, "a.jsonl"), "verifier": "x", "label": "a", "weight": 1},
      {"kind": "jsonl", "path": _qa_file(tmp_path, 100, "b.jsonl"), "verifier": "x", "label": "b", "weight": 1},
  ], "num_epochs": 2}
  examples = list(build_dataset(cfg))
  assert collections.Counter(e["source"] for e in examples) == {"a": 20, "b": 20}


def test_process_shards_are_disjoint_and_cover_the_stream(tmp_path):
  cfg = {"sources": [{"kind": "jsonl", "path": _qa_file(tmp_path, 37), "verifier": "x"},
                     {"kind": "arithmetic", "num_examples": 40}], "num_epochs": 1, "seed": 4}
  full = [e["id"] for e in build_dataset(cfg)]
  shards = [[e["id"] for e in build_dataset(cfg, process_index=p, process_count=3)] for p in range(3)]
  assert sorted(sum(shards, [])) == sorted(full) and len(set(full)) == len(full)
  assert shards[1] == full[1::3]
  with pytest.raises(ConfigError, match="process_index"):
    build_dataset(cfg, process_index=3, process_count=3)


def test_state_restore_resumes_with_identical_batches(tmp_path):
  rows = []
  for i in range(40):
    if i % 7 == 3:
      rows.append("{malformed")
    elif i % 5 == 0:
      rows.append({"prompt": "long " * 20, "answer": str(i)})
    else:
      rows.append({"prompt": f"q{i}", "answer": str(i)})
  cfg = {"sources": [{"kind": "jsonl", "path": _write_jsonl(tmp_path / "d.jsonl", rows), "verifier": "x"},
                     {"kind": "countdown", "weight": 0.5}],
         "max_prompt_tokens": 64, "seed": 11, "num_epochs": 3}
  tok = FakeByteTokenizer()

  reference = PromptBatcher(build_dataset(cfg), tok, 3)
  for _ in range(7):
    next(reference)
  saved = json.loads(json.dumps(reference.state()))  # must survive a JSON round trip
  expected = [next(reference) for _ in range(12)]

  resumed = PromptBatcher(build_dataset(cfg), tok, 3)
  resumed.restore(saved)
  got = [next(resumed) for _ in range(12)]
  assert _ids(got) == _ids(expected)
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(g.prompt_ids, e.prompt_ids)
    np.testing.assert_array_equal(g.prompt_mask, e.prompt_mask)
  assert resumed.stats() == reference.stats()
  assert reference.stats()["malformed"] > 0 and reference.stats()["filtered_too_long"] > 0


def test_restore_rejects_state_of_another_pipeline():
  tok = FakeByteTokenizer()
  a = PromptBatcher(build_dataset({"sources": [{"kind": "arithmetic"}], "seed": 1}), tok, 2)
  b = PromptBatcher(build_dataset({"sources": [{"kind": "arithmetic"}], "seed": 2}), tok, 2)
  next(a)
  with pytest.raises(DataError, match="different data config"):
    b.restore(a.state())
  c = PromptBatcher(build_dataset({"sources": [{"kind": "arithmetic"}], "seed": 1}), tok, 4)
  with pytest.raises(DataError, match="prompts_per_batch=2"):
    c.restore(a.state())
  c.restore(a.state(), strict=False)  # continue from the same row with a new batch size
  assert [e["id"] for e in next(c).examples] == [f"arithmetic:train:{i}" for i in range(2, 6)]
  with pytest.raises(DataError, match="not a version-1"):
    a.restore({"position": 3})


def test_distinct_batcher_skips_repeats_and_ends_when_the_space_is_exhausted(monkeypatch):
  monkeypatch.setattr(batching, "_MAX_CONSECUTIVE_SKIPS", 2000)
  # One-digit held-out problems at the default share: about 19 distinct ones in an endless stream.
  cfg = {"sources": [{"kind": "arithmetic", "difficulty": 1}], "shuffle": False}
  batcher = PromptBatcher(build_dataset(cfg, split="test"), FakeByteTokenizer(), 4, drop_remainder=False,
                          distinct=True)
  prompts = [e["prompt"] for batch in batcher for e in batch.examples]
  assert len(prompts) == len(set(prompts))
  task = build_dataset(cfg, split="test")
  assert set(prompts) == {task[i]["prompt"] for i in range(3000)}   # all of them, each once
  assert batcher.stats()["duplicates"] >= 2000


@pytest.mark.parametrize("total", [40, 37])
def test_block_shards_laid_side_by_side_are_the_single_process_stream(tmp_path, total):
  cfg = {"sources": [{"kind": "jsonl", "path": _qa_file(tmp_path, total), "verifier": "x"}], "num_epochs": 1,
         "seed": 4}
  full = [e["id"] for e in build_dataset(cfg)]
  shards = [[e["id"] for e in build_dataset(cfg, process_index=p, process_count=2, shard_block=4)] for p in range(2)]
  assert sorted(sum(shards, [])) == sorted(full)
  # Batch k of the 2-process run is [process 0's batch k, process 1's batch k] = batch k of 1 process.
  for k in range(total // 8):
    assert shards[0][4 * k:4 * k + 4] + shards[1][4 * k:4 * k + 4] == full[8 * k:8 * k + 8]
  assert build_dataset(cfg, process_index=0, process_count=2, shard_block=4).fingerprint != \
      build_dataset(cfg, process_index=0, process_count=2).fingerprint
  with pytest.raises(ConfigError, match="shard_block"):
    build_dataset(cfg, shard_block=0)
