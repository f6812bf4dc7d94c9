"""Everything checkable from the config and its files is checked before any model is built (issue 39
item 9): `rljax train` stops in about a second, naming the field or file and the fix."""
import json
import os
import time

import pytest

from rljax import cli

SMOKE = os.path.join(os.path.dirname(cli.__file__), "configs", "smoke.py")


def train(capsys, tmp_path, *overrides, dry_run=True):
  argv = ["train", "--config", SMOKE, f"--config.output.dir={tmp_path / 'run'}", *overrides]
  start = time.perf_counter()
  rc = cli.main(argv + (["--dry-run"] if dry_run else []))
  out = capsys.readouterr()
  return rc, out.out, out.err, time.perf_counter() - start


def jsonl_source(path, **extra):
  return "--config.data.sources=" + json.dumps([{"kind": "jsonl", "path": str(path), "verifier": "none",
                                                  **extra}])


def test_config_and_file_mistakes_stop_before_the_model_is_built(tmp_path, capsys):
  no_template = tmp_path / "tok"
  no_template.mkdir()
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(no_template / "tokenizer.json"))
  rows = tmp_path / "rows.jsonl"
  rows.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"q": "2 + 2"}\n{"q": "3 + 3"}\n')
  long_rows = tmp_path / "long.jsonl"
  long_rows.write_text("".join(json.dumps({"prompt": "add " * 40, "answer": "1"}) + "\n" for _ in range(3)))
  cases = [
      (['--config.rewards.components=[{"name": "v", "verifier": "rljax.configs.smoke:vowel_fraction", "wieght": 1}]'],
       "rewards.components[0]: unknown field(s) ['wieght']"),
      (['--config.rewards.components=[{"name": "v", "verifier": "my_verifiers:score", "weight": 1.0}]'],
       "cannot import module 'my_verifiers'"),
      ([f"--config.tokenizer={no_template}", "--config.data.chat_template=True"],
       "config.data.chat_template=True, but the tokenizer of config.tokenizer="),
      ([jsonl_source(rows)],
       "data.sources[0] (jsonl " + str(rows) + ", split 'train'): 2 of 3 rows malformed (first: "),
      ([jsonl_source(long_rows)], "3 of the first 3 prompts are longer than data.max_prompt_tokens=16"),
      (["--config.model.path=/nonexistent/model"], "config.model.path='/nonexistent/model'"),
  ]
  for overrides, message in cases:
    rc, out, err, seconds = train(capsys, tmp_path, *overrides)
    assert rc == 1 and message in err and "Traceback" not in err, (overrides, err)
    assert "loading the model" not in out                # nothing was built
  assert not (tmp_path / "run").exists()


def test_a_few_malformed_rows_are_a_note_and_the_run_builds(tmp_path, capsys):
  rows = tmp_path / "rows.jsonl"
  rows.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"prompt": "2 + 2", "answer": "4"}\n{"q": "3 + 3"}\n')
  rc, out, err, _ = train(capsys, tmp_path, jsonl_source(rows))
  assert rc == 0, err
  assert "note: data.sources[0] (jsonl" in out and "1 of 3 rows malformed" in out and "config OK" in out


def test_a_verifier_module_in_the_working_directory_imports_from_the_console_script(tmp_path):
  """Item 10: the `rljax` console script's sys.path starts at its bin directory, not the working
  directory; rljax adds the working directory, as `python -m` does."""
  import subprocess
  import sys
  (tmp_path / "my_verifiers.py").write_text("def score(completion, example):\n  return 1.0\n")
  console = ("import os, sys\n"
             "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]   # as the console script has it\n"
             "from rljax.cli import main\n"
             "sys.argv[0] = 'rljax'\n"
             "sys.exit(main(sys.argv[1:]))\n")
  component = '[{"name": "mine", "verifier": "my_verifiers:score", "weight": 1.0}]'
  root = os.path.dirname(os.path.dirname(cli.__file__))
  proc = subprocess.run([sys.executable, "-c", console, "config", "show", "--config", SMOKE,
                         f"--config.rewards.components={component}"], cwd=tmp_path, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": root}, timeout=120)
  assert proc.returncode == 0 and proc.stdout.rstrip().endswith("# validation: OK"), proc.stdout[-2000:] + proc.stderr
