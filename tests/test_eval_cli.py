"""`rljax eval` end to end on the real SmolLM2-135M-Instruct, and evaluation inside training."""
import json
import os
import re

import numpy as np
import pytest
from test_trainer import Trainer, read_metrics, smoke

from rljax.trainer.evaluate import drop_common_padding, eval_main, summarize


def test_rljax_eval_writes_consistent_metrics_and_per_example_results(tmp_path, capsys):
  out = tmp_path / "eval.jsonl"
  rc = eval_main(["--data", "arithmetic", "--difficulty", "1", "--held-out-fraction", "0.5", "--samples", "4",
                  "--temperature", "0.7", "--num-examples", "8", "--max-new-tokens", "12",
                  "--max-prompt-tokens", "48", "--prompt-template", "{prompt}\nAnswer with just the number.",
                  "--out", str(out)])
  assert rc == 0
  captured = capsys.readouterr()
  printed = captured.out
  metrics = json.loads(printed[:printed.rindex("}") + 1])
  # Issue 22: never minutes without a line. It says what it loads and evaluates, counts examples on a
  # progress bar, and prints the result when it ends (stderr), besides the JSON figures (stdout).
  assert "rljax eval: loading smollm2-135m-instruct" in captured.err
  assert "eval arithmetic (test): scoring 4 completions for each of up to 8 held-out examples" in captured.err
  assert "8/8" in captured.err
  assert f"eval arithmetic (test): accuracy {100 * metrics['accuracy']:.1f}% +- " in captured.err
  assert f"accuracy {100 * metrics['accuracy']:.1f}% +- " in printed and f"per-example results: {out}" in printed
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(rows) == 8 and metrics["num_examples"] == 8
  assert len({r["prompt"] for r in rows}) == 8            # distinct held-out problems
  for r in rows:
    assert len(r["completions"]) == len(r["correct"]) == len(r["answers"]) == 4
    # The verifier's verdict agrees with the reference answer it reports.
    for answer, correct in zip(r["answers"], r["correct"]):
      assert correct == (answer == r["answer"])
  # The printed figures are the aggregate of the per-example file.
  again = summarize(rows, 4)
  for key in ("accuracy", "accuracy_stderr", "pass@1", "pass@4", "maj@4"):
    assert metrics[key] == pytest.approx(again[key])
  assert metrics["pass@4"] >= metrics["accuracy"] >= 0.0
  # This model answers one-digit sums correctly about half the time (52% greedy on 128 problems).
  assert 0.0 < metrics["pass@4"]


def test_shared_prefix_prefill_gives_the_same_completions(tmp_path, capsys):
  """The chat template's system prompt is the same in every prompt: `rljax eval` prefills it once
  per batch by default, and the greedy completions equal those of `--no-shared-prefix` (the plain
  prefill of every prompt), on the real SmolLM2."""
  runs = {}
  for name, extra in (("shared", []), ("plain", ["--no-shared-prefix"])):
    out = tmp_path / f"{name}.jsonl"
    rc = eval_main(["--data", "arithmetic", "--difficulty", "1", "--held-out-fraction", "0.5", "--num-examples", "8",
                    "--max-new-tokens", "12", "--max-prompt-tokens", "64", "--batch-size", "8", "--quiet",
                    "--out", str(out), *extra])
    assert rc == 0
    printed = capsys.readouterr().out
    runs[name] = (json.loads(printed[:printed.rindex("}") + 1]), [json.loads(x) for x in out.read_text().splitlines()])
  assert runs["shared"][0]["shared_prefix_tokens"] >= 8      # SmolLM2's default system prompt, at least
  assert runs["plain"][0]["shared_prefix_tokens"] == 0
  assert [r["completions"] for r in runs["shared"][1]] == [r["completions"] for r in runs["plain"][1]]
  assert runs["shared"][0]["accuracy"] == runs["plain"][0]["accuracy"]


def test_drop_common_padding_keeps_every_real_token_and_one_width():
  ids = np.array([[0, 0, 7, 7, 0, 0, 0, 5], [0, 0, 7, 7, 0, 0, 4, 5], [0, 0, 7, 7, 0, 3, 4, 5]])
  mask = ids > 0
  # The first 4 columns stay as they are (a shared prefix); after them the longest row has 3 tokens.
  trimmed, tmask = drop_common_padding(ids, mask, 4)
  assert trimmed.tolist() == [[0, 0, 7, 7, 0, 0, 5], [0, 0, 7, 7, 0, 4, 5], [0, 0, 7, 7, 3, 4, 5]]
  assert (tmask == (trimmed > 0)).all()
  assert drop_common_padding(ids, mask, 4, width=8)[0].tolist() == ids.tolist()   # the full width
  assert drop_common_padding(ids, mask, 4, width=6)[0].tolist() == ids.tolist()   # the rows do not fit in 6
  assert drop_common_padding(ids, mask, 0)[0].tolist() == ids.tolist()   # padding between real tokens: kept
  left = np.array([[0, 0, 0, 5], [0, 0, 4, 5]])
  assert drop_common_padding(left, left > 0, 0)[0].tolist() == [[0, 5], [4, 5]]
  right = np.array([[5, 0, 0], [4, 5, 0]])
  assert drop_common_padding(right, right > 0, 0)[0].tolist() == right.tolist()   # right-padded: as given


def test_dropping_common_padding_gives_the_same_completions(tmp_path, capsys, monkeypatch):
  """Prompts padded to 96 columns: the evaluation drops the columns that are padding in every row,
  and its greedy completions equal those of the padded prompts, on the real SmolLM2, with and
  without the shared-prefix prefill."""
  from rljax.trainer import evaluate
  runs = {}
  for trimmed in (True, False):
    if not trimmed:
      monkeypatch.setattr(evaluate, "drop_common_padding", lambda ids, mask, keep, width=None: (ids, mask))
    for extra in ([], ["--no-shared-prefix"]):
      out = tmp_path / f"{trimmed}{len(extra)}.jsonl"
      rc = eval_main(["--data", "arithmetic", "--difficulty", "1", "--held-out-fraction", "0.5", "--num-examples",
                      "8", "--max-new-tokens", "12", "--max-prompt-tokens", "96", "--batch-size", "8", "--quiet",
                      "--out", str(out), *extra])
      assert rc == 0
      capsys.readouterr()
      runs[trimmed, len(extra)] = [json.loads(x)["completions"] for x in out.read_text().splitlines()]
  for shared in (0, 1):
    assert runs[True, shared] == runs[False, shared]
    assert len(runs[True, shared]) == 8


def test_eval_rejects_unknown_procedural_settings(tmp_path):
  with pytest.raises(Exception, match="held_out_fraction=0.3"):
    eval_main(["--data", "arithmetic", "--held-out-fraction", "0.3", "--out", str(tmp_path / "e.jsonl")])


def test_eval_every_runs_inside_training_and_reaches_the_metrics(tmp_path, capfd):
  cfg = smoke(tmp_path, "train.steps=4", "eval.every=2", "eval.num_examples=8", "eval.before_and_after=True",
              "checkpoint.every=2", "checkpoint.async_save=False")
  summary = Trainer(cfg).run()
  metrics = read_metrics(summary["metrics_file"])
  evals = {m["step"]: m for m in metrics if "eval/accuracy" in m}
  if cfg.output.progress:   # the trainer's evaluations announce themselves and print their result (stderr)
    err = capfd.readouterr().err
    assert "eval before training: scoring 1 completion for each of up to 8 held-out examples" in err
    assert re.search(r"eval at step 2: accuracy [0-9.]+% \+- [0-9.]+ over 8 examples", err), err[-2000:]
  assert sorted(evals) == [0, 2, 4]                       # before, every 2 steps, after
  for m in evals.values():
    assert m["eval/num_examples"] == 8 and 0.0 <= m["eval/accuracy"] <= 1.0
  run = os.path.dirname(summary["metrics_file"])
  for tag in ("before", "step2", "after"):
    assert len(open(os.path.join(run, f"eval_{tag}.jsonl")).read().splitlines()) == 8
  # The checkpoint at step 2 records the evaluation it was saved with (best-by-metric needs it).
  from rljax.trainer.checkpoint import Checkpointer
  ckpt = Checkpointer(summary["checkpoint_dir"])
  assert ckpt.metrics(2)["eval/accuracy"] == pytest.approx(evals[2]["eval/accuracy"])
  assert np.isfinite(evals[4]["eval/accuracy_stderr"])


def test_rljax_eval_with_tools_records_calls_per_completion(tmp_path, capsys):
  """`--tools` runs multi-turn rollouts on the real SmolLM2: each completion's tool calls are
  recorded and the printed tool figures are the aggregate of the per-example file. (This model
  seldom calls a tool here; tests/test_multiturn.py scripts calls through the same evaluation.)"""
  out = tmp_path / "eval.jsonl"
  rc = eval_main(["--data", "arithmetic", "--difficulty", "2", "--samples", "2", "--temperature", "1.0",
                  "--num-examples", "4", "--max-new-tokens", "48", "--max-prompt-tokens", "128",
                  "--system-prompt", "Compute the answer by writing a ```python block that prints it.",
                  "--tools", "python", "--tool-format", "python", "--max-turns", "2", "--out", str(out)])
  assert rc == 0
  printed = capsys.readouterr().out
  metrics = json.loads(printed[:printed.rindex("}") + 1])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(rows) == 4
  for r in rows:
    assert len(r["tool_calls"]) == len(r["tool_errors"]) == len(r["completions"]) == 2
    assert all(0 <= e <= c <= 2 for c, e in zip(r["tool_calls"], r["tool_errors"]))
  assert metrics["tool_calls_per_completion"] == pytest.approx(np.mean([c for r in rows for c in r["tool_calls"]]))
  assert summarize(rows, 2)["tool_error_rate"] == pytest.approx(metrics["tool_error_rate"])


def test_rljax_eval_rejects_bad_tool_settings(tmp_path):
  from rljax.errors import ConfigError
  base = ["--data", "arithmetic", "--out", str(tmp_path / "e.jsonl")]
  with pytest.raises(ConfigError, match="tool-kwargs is not valid JSON"):
    eval_main(base + ["--tools", "python", "--tool-kwargs", "{python: 1}"])
  with pytest.raises(ConfigError, match="nosuchtool"):
    eval_main(base + ["--tools", "nosuchtool"])
