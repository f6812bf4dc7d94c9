"""Data sources: JSONL, Parquet, JSON/MATH directories, tfds array_record, GSM8K/MATH layouts, config errors."""
import json

import numpy as np
import pytest

from rljax.data import Malformed, build_dataset, extract_boxed, extract_gsm8k_answer
from rljax.errors import ConfigError, DataError


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def _examples(ds):
  return [ds[i] for i in range(len(ds))]


def test_jsonl_field_mapping_template_and_system_prompt(tmp_path):
  path = _write_jsonl(tmp_path / "qa.jsonl", [
      {"q": "What is 2+2?", "a": 4, "uid": "x1", "unit": "apples"},
      {"q": "What is 3+3?", "a": "6", "uid": "x2", "unit": "pears"},
  ])
  cfg = {
      "sources": [{"kind": "jsonl", "path": path, "verifier": "numeric",
                   "fields": {"prompt": "q", "answer": "a", "id": "uid", "extra": ["unit"]}}],
      "system_prompt": "Think step by step.",
      "prompt_template": "{prompt} (in {unit})",
      "shuffle": False, "num_epochs": 1,
  }
  first, second = _examples(build_dataset(cfg))
  assert first["prompt"] == "What is 2+2? (in apples)"
  assert first["answer"] == "4" and first["id"] == "x1" and first["unit"] == "apples"
  assert first["verifier"] == "numeric" and first["source"] == "jsonl"
  assert first["prompt_messages"] == [
      {"role": "system", "content": "Think step by step."},
      {"role": "user", "content": "What is 2+2? (in apples)"},
  ]
  assert second["answer"] == "6"


def test_parquet_source(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  table = pa.table({"prompt": ["a?", "b?", "c?"], "answer": ["1", "2", "3"], "unused": [0, 1, 2]})
  pq.write_table(table, tmp_path / "d.parquet")
  cfg = {"sources": [{"kind": "parquet", "path": str(tmp_path / "d.parquet"), "verifier": "exact"}],
         "shuffle": False, "num_epochs": 1}
  examples = _examples(build_dataset(cfg))
  assert [e["prompt"] for e in examples] == ["a?", "b?", "c?"]
  assert [e["answer"] for e in examples] == ["1", "2", "3"]
  assert "unused" not in examples[0]


def test_parquet_missing_column_names_file_and_columns(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"question": ["a?"]}), tmp_path / "d.parquet")
  cfg = {"sources": [{"kind": "parquet", "path": str(tmp_path), "verifier": "exact"}]}
  with pytest.raises(DataError, match=r"d\.parquet.*no column.*'prompt'.*available columns.*question"):
    build_dataset(cfg)


def test_gsm8k_layout(tmp_path):
  path = _write_jsonl(tmp_path / "gsm8k.jsonl", [
      {"question": "Tom has 3 apples...", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
      {"question": "A big number?", "answer": "Lots.\n#### 1,234"},
  ])
  cfg = {"sources": [{"kind": "gsm8k", "path": path}], "shuffle": False, "num_epochs": 1}
  a, b = _examples(build_dataset(cfg))
  assert (a["answer"], b["answer"]) == ("7", "1234")
  assert a["solution"].startswith("3 + 4") and a["verifier"] == "gsm8k"
  assert a["prompt"] == "Tom has 3 apples..."


def test_math_layout_directory_of_json_files(tmp_path):
  # The original MATH release: one JSON object per problem, in subject folders.
  (tmp_path / "algebra").mkdir()
  (tmp_path / "geometry").mkdir()
  json.dump({"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 2"},
            open(tmp_path / "algebra" / "1.json", "w"))
  json.dump({"problem": "Sides?", "solution": "So \\boxed 3 sides, not \\fbox{4}... final $\\boxed{3}$"},
            open(tmp_path / "geometry" / "2.json", "w"))
  cfg = {"sources": [{"kind": "math", "path": str(tmp_path), "fields": {"extra": {"level": "level"}}}],
         "shuffle": False, "num_epochs": 1, "on_malformed": "skip"}
  items = _examples(build_dataset(cfg))
  assert items[0]["answer"] == "\\frac{1}{2}" and items[0]["level"] == "Level 2"
  # The second file lacks "level": skipped as malformed, naming the file.
  assert isinstance(items[1], Malformed) and "2.json" in items[1].where and "level" in items[1].reason


def test_math_layout_jsonl(tmp_path):
  path = _write_jsonl(tmp_path / "math.jsonl", [{"problem": "p", "solution": "x \\boxed{42}"}])
  (ex,) = _examples(build_dataset({"sources": [{"kind": "math", "path": path}], "num_epochs": 1}))
  assert ex["answer"] == "42" and ex["verifier"] == "math"


@pytest.mark.parametrize("text,expected", [
    ("$\\boxed{5}$", "5"),
    ("\\boxed{1} then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed{\\frac{a}{b+\\{c\\}}}", "\\frac{a}{b+\\{c\\}}"),
    ("\\fbox{x}", "x"),
    ("so \\boxed 7.", "7."),
])
def test_extract_boxed(text, expected):
  assert extract_boxed(text) == expected


@pytest.mark.parametrize("text", ["no box", "\\boxed{1", "\\boxed{}"])
def test_extract_boxed_failures(text):
  with pytest.raises(Exception, match="boxed"):
    extract_boxed(text)


def test_extract_gsm8k_answer():
  assert extract_gsm8k_answer("a #### b\n#### -3,000 ") == "-3000"
  with pytest.raises(Exception, match="####"):
    extract_gsm8k_answer("no marker")


def test_malformed_rows_skip_with_position(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", [
      {"prompt": "ok", "answer": "1"},
      "{not json",
      {"prompt": "no answer"},
      "[1, 2]",
      {"prompt": "", "answer": "2"},
      {"prompt": "ok too", "answer": "3"},
  ])
  cfg = {"sources": [{"kind": "jsonl", "path": path, "verifier": "exact"}], "shuffle": False, "num_epochs": 1}
  items = _examples(build_dataset(cfg))
  bad = [x for x in items if isinstance(x, Malformed)]
  assert [x.where for x in bad] == [f"{path} line {n}" for n in (2, 3, 4, 5)]
  assert "invalid JSON" in bad[0].reason and "answer" in bad[1].reason
  assert [e["answer"] for e in build_dataset(cfg)] == ["1", "3"]  # iteration skips them


def test_malformed_rows_raise_with_position(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, "", "{oops"])
  cfg = {"sources": [{"kind": "jsonl", "path": path, "verifier": "exact"}], "shuffle": False,
         "num_epochs": 1, "on_malformed": "raise"}
  ds = build_dataset(cfg)
  assert ds[0]["answer"] == "1"  # the blank line is not a row
  with pytest.raises(DataError, match=r"bad\.jsonl line 3: malformed row.*invalid JSON.*on_malformed: skip"):
    ds[1]


def test_tfds_array_record_source_without_tensorflow(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")

  class RljaxTinyQa(tfds.core.GeneratorBasedBuilder):
    """Test double: a tiny dataset written in array_record format."""
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "question": tfds.features.Text(), "answer": tfds.features.Text(),
          "nums": tfds.features.Tensor(shape=(2,), dtype=np.int32)}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(6), "test": self._generate_examples(2)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {"question": f"q{i}", "answer": f"work #### {i}", "nums": [i, i + 1]}

  RljaxTinyQa(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
  base = {"kind": "tfds", "verifier": "gsm8k", "answer_format": "gsm8k",
          "fields": {"prompt": "question", "extra": ["nums"]}}
  by_name = {"sources": [{**base, "name": "rljax_tiny_qa", "data_dir": str(tmp_path)}], "num_epochs": 1}
  examples = list(build_dataset(by_name, split="train"))
  assert sorted(e["prompt"] for e in examples) == [f"q{i}" for i in range(6)]
  ex = next(e for e in examples if e["prompt"] == "q3")
  assert ex["answer"] == "3" and ex["nums"] == [3, 4]
  by_path = {"sources": [{**base, "path": str(tmp_path / "rljax_tiny_qa" / "1.0.0"), "split": {"eval": "test"}}],
             "num_epochs": 1}
  assert len(list(build_dataset(by_path, split="eval"))) == 2


def test_tfds_missing_dataset_is_a_data_error(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  cfg = {"sources": [{"kind": "tfds", "name": "rljax_no_such_ds", "data_dir": str(tmp_path), "verifier": "x"}]}
  with pytest.raises(DataError, match="cannot open tfds rljax_no_such_ds"):
    build_dataset(cfg)


def test_path_per_split_and_num_examples(tmp_path):
  train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"t{i}", "answer": "1"} for i in range(10)])
  test = _write_jsonl(tmp_path / "test.jsonl", [{"prompt": f"e{i}", "answer": "1"} for i in range(4)])
  cfg = {"sources": [{"kind": "jsonl", "verifier": "x", "path": {"train": train, "test": test}, "num_examples": 3}],
         "shuffle": False, "num_epochs": 1}
  assert [e["prompt"] for e in build_dataset(cfg, split="test")] == ["e0", "e1", "e2"]
  with pytest.raises(ConfigError, match=r"path: no entry for split 'validation'"):
    build_dataset(cfg, split="validation")


def test_directory_and_glob_read_files_in_sorted_order(tmp_path):
  _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "answer": "1"}])
  _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "answer": "1"}])
  (tmp_path / "notes.txt").write_text("ignored")
  for path in (str(tmp_path), str(tmp_path / "*.jsonl")):
    cfg = {"sources": [{"kind": "jsonl", "verifier": "x", "path": path}], "shuffle": False, "num_epochs": 1}
    assert [e["prompt"] for e in build_dataset(cfg)] == ["a", "b"]


def test_config_dict_is_accepted(tmp_path):
  ml_collections = pytest.importorskip("ml_collections")
  cfg = ml_collections.ConfigDict({"sources": [{"kind": "arithmetic", "num_examples": 5}], "seed": 3, "num_epochs": 1})
  assert len(build_dataset(cfg)) == 5
  # FrozenConfigDict cannot hold a list of dicts: sources may be a mapping label -> source.
  frozen = ml_collections.FrozenConfigDict({"sources": {"easy": {"kind": "arithmetic", "num_examples": 4}},
                                            "num_epochs": 1})
  ds = build_dataset(frozen)
  assert len(ds) == 4 and ds[0]["source"] == "easy"


@pytest.mark.parametrize("cfg,pattern", [
    ({"sources": [{"kind": "arithmetic"}], "shufle": True}, r"data\.shufle: unknown field"),
    ({"sources": [{"kind": "arithmetic", "pth": "x"}]}, r"data\.sources\[0\]\.pth: unknown field"),
    ({"sources": [{"kind": "csv"}]}, r"data\.sources\[0\]\.kind='csv'"),
    ({"sources": []}, r"data\.sources: expected a non-empty list"),
    ({"sources": [{"kind": "jsonl", "path": "x.jsonl"}]}, r"sources\[0\]\.verifier: required"),
    ({"sources": [{"kind": "arithmetic", "path": "x"}]}, r"sources\[0\]\.path: not used by kind 'arithmetic'"),
    ({"sources": [{"kind": "countdown", "difficulty": 9}]}, r"difficulty=9: expected an integer from 1 to 4"),
    ({"sources": [{"kind": "arithmetic", "weight": 0}]}, r"weight=0: expected a number > 0"),
    ({"sources": [{"kind": "arithmetic"}], "prompt_template": "{prompt} {unit}"}, r"placeholder \{unit\}"),
    ({"sources": [{"kind": "arithmetic"}], "on_malformed": "ignore"}, r"on_malformed='ignore'"),
    ({"sources": [{"kind": "arithmetic"}], "num_epochs": 0}, r"num_epochs=0"),
    ({"sources": [{"kind": "jsonl", "verifier": "x", "path": "p", "fields": {"extra": ["answer"]}}]},
     r"extra\.answer: 'answer' is reserved"),
    ({"sources": [{"kind": "arithmetic", "label": "a"}, {"kind": "countdown", "label": "a"}]}, r"label 'a' is used "
                                                                                               r"by more than one"),
    ({"sources": [{"kind": "tfds", "verifier": "x"}]}, r"exactly one of 'name'"),
])
def test_config_errors_name_the_field(cfg, pattern):
  with pytest.raises(ConfigError, match=pattern):
    build_dataset(cfg)


def test_missing_file_is_a_data_error(tmp_path):
  cfg = {"sources": [{"kind": "gsm8k", "path": str(tmp_path / "nope.jsonl")}]}
  with pytest.raises(DataError, match=r"data\.sources\[0\]: no file matches .*nope\.jsonl"):
    build_dataset(cfg)


def test_json_list_file_and_gsm8k_marker_missing(tmp_path):
  path = tmp_path / "rows.json"
  json.dump([{"question": "a?", "answer": "x #### 1"}, {"question": "b?", "answer": "no marker"}], open(path, "w"))
  cfg = {"sources": [{"kind": "gsm8k", "path": str(path)}], "shuffle": False, "num_epochs": 1, "on_malformed": "raise"}
  ds = build_dataset(cfg)
  assert ds[0]["answer"] == "1"
  with pytest.raises(DataError, match=r"rows\.json item 1: malformed row.*'####'"):
    ds[1]


def test_source_without_a_valid_row_names_the_file_and_first_errors(tmp_path):
  """Issue 22 item 2: with on_malformed=skip and endless epochs, a file of bad rows used to be
  skipped row by row forever; now building the dataset says which file and why."""
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"q": "1 + 1", "a": "2"}, "{not json", {"q": "2 + 2"}, {"q": "x"}])
  cfg = {"sources": [{"kind": "jsonl", "path": path, "verifier": "exact"}]}   # on_malformed=skip, num_epochs=None
  with pytest.raises(DataError) as e:
    build_dataset(cfg)
  msg = str(e.value)
  assert "data.sources[0]" in msg and "none of its 4 rows is a valid example" in msg
  assert f"{path} line 1: missing prompt field 'prompt'" in msg and f"{path} line 2: invalid JSON" in msg
  assert "line 4" not in msg                     # the first errors, not all of them
  assert "'fields'" in msg                       # and the fix
  # One valid row anywhere is enough.
  _write_jsonl(tmp_path / "bad.jsonl", [{"q": "1 + 1"}] * 3 + [{"prompt": "ok", "answer": "1"}])
  assert len(build_dataset(cfg)) > 0


def test_eval_reads_training_data_finds_one_path_for_every_split():
  from rljax.data.config import eval_reads_training_data
  file = {"kind": "jsonl", "verifier": "exact"}
  assert eval_reads_training_data({"sources": [{**file, "path": "train.jsonl"}]}) == [
      "data.sources[0].path='train.jsonl' (one path for every split)"]
  assert eval_reads_training_data({"sources": [{**file, "path": {"train": "a.jsonl", "test": "./a.jsonl"}}]})
  assert eval_reads_training_data({"sources": [{**file, "path": {"train": "a.jsonl", "test": "b.jsonl"}}]}) == []
  assert eval_reads_training_data({"sources": [{"kind": "arithmetic"}, {"kind": "tfds", "name": "gsm8k",
                                                                        "verifier": "gsm8k"}]}) == []
  assert eval_reads_training_data({"sources": [{"kind": "tfds", "name": "gsm8k", "verifier": "gsm8k",
                                                "split": "train"}]}) == [
      "data.sources[0].split='train' (the same tfds split for training and evaluation)"]


def test_overlong_jsonl_line_is_a_malformed_row_read_in_bounded_memory(tmp_path):
  # A 4 MB line (with a 64 KB bound) is skipped while the file is indexed, never held in memory,
  # and counted as a malformed row with its position; the rows around it are read.
  import tracemalloc
  path = tmp_path / "big.jsonl"
  with open(path, "w") as f:
    f.write(json.dumps({"prompt": "first", "answer": "1"}) + "\n")
    f.write('{"prompt": "' + "x" * (4 << 20) + '", "answer": "2"}\n')
    f.write(json.dumps({"prompt": "last", "answer": "3"}) + "\n")
  cfg = {"sources": [{"kind": "jsonl", "path": str(path), "verifier": "math"}], "max_line_bytes": 65536,
         "shuffle": False, "num_epochs": 1}
  _examples(build_dataset(cfg))  # imports and caches outside the measurement
  tracemalloc.start()
  try:
    items = _examples(build_dataset(cfg))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 1 << 20, peak  # the 4 MB line was never held in memory
  assert [e["prompt"] for e in items if not isinstance(e, Malformed)] == ["first", "last"]
  (bad,) = [e for e in items if isinstance(e, Malformed)]
  assert bad.where.endswith("big.jsonl line 2") and "more than data.max_line_bytes=65536" in bad.reason
  with pytest.raises(DataError, match="line 2.*max_line_bytes"):
    _examples(build_dataset({**cfg, "on_malformed": "raise"}))
  with pytest.raises(ConfigError, match="data.max_line_bytes"):
    build_dataset({**cfg, "max_line_bytes": 10})


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_utf16_jsonl_is_refused_naming_the_encoding(tmp_path, encoding):
  # UTF-16/32 JSONL (with a byte-order mark or not) is refused, not read "by accident" minus a row.
  rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
  path = tmp_path / "wide.jsonl"
  path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode(encoding))
  with pytest.raises(DataError, match=r"wide.jsonl' is UTF-(16|32)-[LB]E.*must be UTF-8.*iconv"):
    build_dataset({"sources": [{"kind": "jsonl", "path": str(path), "verifier": "math"}], "shuffle": False,
                   "num_epochs": 1})
  # UTF-8 with a byte-order mark is read, every row.
  path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode("utf-8-sig"))
  source = {"kind": "jsonl", "path": str(path), "verifier": "math"}
  got = _examples(build_dataset({"sources": [source], "shuffle": False, "num_epochs": 1}))
  assert [e["prompt"] for e in got] == ["q0", "q1", "q2"]
