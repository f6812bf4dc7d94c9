"""Per-source reward routing (issue 35): `by_source` components, `sources` restrictions, the checks
that refuse an unrouted mixture, per-source metrics, and all of it through the CLI."""
import json
import os
import textwrap

import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.rewards import RewardPool, RewardResult, RewardSpec, register_verifier
from rljax.rewards.callback import combine_process_metrics


@register_verifier("test_route_calc")
def calc_check(completion, example):
  """The 'calc' source's verifier: refuses (raises on) any other source's row."""
  if example["source"] != "calc":
    raise AssertionError(f"calc verifier called on a {example['source']} row")
  return RewardResult(float(completion == example["answer"]), {"calc_calls": 1})


@register_verifier("test_route_words", kind="group")
def words_check(completions, example, *, bonus: float = 1.0):
  """The 'words' source's verifier (a group kind): 1 for completions that are all letters."""
  if example["source"] != "words":
    raise AssertionError(f"words verifier called on a {example['source']} row")
  return [bonus * float(c.isalpha()) for c in completions]


@register_verifier("test_route_short")
def short(completion, example):
  return float(len(completion) <= 2)


SOURCES = {"calc": "test_route_calc", "words": "test_route_words", "free": "none"}


def _spec(components, sources=SOURCES, **kw):
  return RewardSpec.from_dict({"components": components, "num_workers": 0, **kw}, source_verifiers=sources)


def _batch():
  """Two prompts per source (G = 2): calc rows 0-3, words rows 4-7, free rows 8-11."""
  examples = [{"source": "calc", "answer": "4"}, {"source": "calc", "answer": "9"},
              {"source": "words", "answer": None}, {"source": "words", "answer": None},
              {"source": "free", "answer": None}, {"source": "free", "answer": None}]
  completions = ["4", "5", "9", "9", "abc", "a1", "xyz", "zz", "4", "hello", "x", "yy"]
  return completions, examples


def test_by_source_scores_each_row_with_its_sources_verifier_only():
  spec = _spec([{"name": "correct", "verifier": "by_source"},
                {"name": "short", "verifier": "test_route_short", "weight": 0.5, "sources": ["words", "free"]}])
  completions, examples = _batch()
  with RewardPool(spec) as pool:
    assert sorted(v.name for v in pool.verifiers) == ["test_route_calc", "test_route_short", "test_route_words"]
    out = pool.score(completions, examples, group_size=2)
  assert out.metrics["verifier/errors"] == 0, out.errors     # no verifier saw another source's row
  applies = out.applies
  assert applies["correct"].tolist() == [True] * 8 + [False] * 4           # 'free' names no verifier
  assert applies["short"].tolist() == [False] * 4 + [True] * 8
  np.testing.assert_allclose(out.components["correct"], [1, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0])
  np.testing.assert_allclose(out.components["short"], [0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1, 1])
  np.testing.assert_allclose(out.rewards, [1, 0, 1, 1, 1, 0.5, 1, 1.5, 0.5, 0, 0.5, 0.5])
  m = out.metrics
  # A component's figures are over the rows it scores, and only those.
  assert m["reward/correct_mean"] == pytest.approx(6 / 8) and m["reward/short_mean"] == pytest.approx(5 / 8)
  assert out.metric_rows["reward/correct_mean"] == 8 and out.metric_rows["reward/short_pass"] == 8
  assert m["info/correct/calc_calls"] == 1 and out.metric_rows["info/correct/calc_calls"] == 4
  # Per source: the mean total reward; accuracy of the first component that scores the source.
  assert m["reward/source/calc/mean"] == pytest.approx(0.75) and m["reward/source/calc/accuracy"] == 0.75
  assert m["reward/source/words/mean"] == pytest.approx(1.0) and m["reward/source/words/accuracy"] == 0.75
  assert m["reward/source/free/mean"] == pytest.approx(0.375) and m["reward/source/free/accuracy"] == 0.75
  assert m["reward/accuracy"] == pytest.approx(9 / 12)


def test_flagged_accuracy_gates_and_rows_no_component_scores():
  spec = _spec([{"name": "correct", "verifier": "by_source", "sources": ["calc", "words"]},
                {"name": "short", "verifier": "test_route_short", "sources": ["calc"], "gate": "correct",
                 "accuracy": True}])
  completions, examples = _batch()
  with RewardPool(spec) as pool:
    out = pool.score(completions, examples, group_size=2)
  # short is gated by correct and flagged for accuracy where it applies (calc); words falls back to
  # the first component that scores it; free rows are scored by nothing: reward 0, no accuracy.
  np.testing.assert_allclose(out.rewards[:4], [2, 0, 2, 2])
  np.testing.assert_allclose(out.rewards[8:], 0)
  assert out.metrics["reward/source/calc/accuracy"] == 0.75 and out.metrics["reward/short_pass"] == 0.75
  assert out.metrics["reward/source/words/accuracy"] == 0.75
  assert "reward/source/free/accuracy" not in out.metrics and out.metrics["reward/source/free/mean"] == 0
  assert out.metrics["reward/accuracy"] == 0.75 and out.metric_rows["reward/accuracy"] == 8


def test_examples_without_a_source_label_fail_only_restricted_components():
  spec = _spec([{"name": "short", "verifier": "test_route_short"},
                {"name": "correct", "verifier": "by_source"}])
  with RewardPool(spec) as pool:
    with pytest.raises(ValueError, match=r"'correct' scores only the sources .* no 'source' label"):
      pool.score(["a"], [{"answer": "a"}])
  plain = RewardSpec.from_dict({"components": [{"name": "short", "verifier": "test_route_short"}], "num_workers": 0})
  with RewardPool(plain) as pool:
    out = pool.score(["a", "abc"], [{}, {}])
  assert out.rewards.tolist() == [1.0, 0.0] and not any(k.startswith("reward/source/") for k in out.metrics)


@pytest.mark.parametrize("components, sources, match", [
    # The defect of issue 35: a math + code style mixture scored by one fixed verifier.
    ([{"name": "correct", "verifier": "test_route_calc"}], None,
     r"data.sources\[1\].verifier='test_route_words' \(source 'words'\) is not used by any reward component.*"
     r"'verifier': 'by_source'.*'sources': \['words'\]"),
    ([{"name": "correct", "verifier": "test_route_calc"}, {"name": "w", "verifier": "test_route_words"}], None,
     r"components\[0\] \('correct'\) scores the rows of data.sources\[1\] \('words'\) with verifier "
     r"'test_route_calc'.*sources: \['calc'\]"),
    ([{"name": "correct", "verifier": "by_source", "sources": ["calc", "nope"]}], None,
     r"components\[0\] \('correct'\).sources: 'nope' is not a data source label"),
    ([{"name": "correct", "verifier": "by_source", "sources": ["calc"]}], None, r"sources\[1\].verifier="),
    ([{"name": "g", "verifier": "by_source", "sources": ["calc"]},
      {"name": "s", "verifier": "test_route_short", "gate": "g"}], {"calc": "test_route_calc"},
     r"components\[1\] \('s'\).gate 'g' scores only the sources \['calc'\], so it cannot gate every source"),
    ([{"name": "correct", "verifier": "by_source"}], {}, r"'by_source' needs the data sources' verifiers"),
    ([{"name": "correct", "verifier": "by_source"}], {"calc": "by_source"}, r"sources\[0\] \('calc'\).verifier="),
    ([{"name": "correct", "verifier": "by_source", "kwargs": {"bonus": 2.0}}], None,
     r"verifier 'test_route_calc' of sources \['calc'\]\).kwargs: verifier 'test_route_calc' takes no keyword "
     r"argument 'bonus'"),
])
def test_routing_errors_name_the_field_and_the_fix(components, sources, match):
  with pytest.raises(ConfigError, match=match):
    _spec(components, SOURCES if sources is None else sources)


def test_per_source_metrics_combine_over_processes_by_their_rows():
  """A component's or a source's mean over two processes is weighted by the rows it covers on
  each, so it equals the figure of one process scoring every row."""
  spec = _spec([{"name": "correct", "verifier": "by_source"},
                {"name": "short", "verifier": "test_route_short", "sources": ["words"]}])
  completions, examples = _batch()
  with RewardPool(spec) as pool:
    whole = pool.score(completions, examples, group_size=2)
    parts = [pool.score(completions[:2], examples[:1], group_size=2),      # one calc prompt
             pool.score(completions[2:], examples[1:], group_size=2)]      # the rest
  summary = lambda b: {"n": len(b.rewards), "rewards": b.rewards.astype(np.float64).tolist(),   # noqa: E731
                       "metrics": b.metrics, "rows": b.metric_rows}
  combined = combine_process_metrics([summary(p) for p in parts])
  for key in ("reward/correct_mean", "reward/short_mean", "reward/source/calc/mean", "reward/source/calc/accuracy",
              "reward/source/words/accuracy", "reward/accuracy", "reward/mean"):
    assert combined[key] == pytest.approx(whole.metrics[key], abs=1e-12), key


# ---- through the CLI ----------------------------------------------------------------------------------


@pytest.fixture
def route_module(tmp_path, monkeypatch):
  """Verifiers importable by the pool's workers: each raises on a row of the other source."""
  mod = tmp_path / "mod"
  mod.mkdir()
  (mod / "route_verifiers.py").write_text(textwrap.dedent("""
      def easy(completion, example):
        assert example["source"] == "easy", example["source"]
        return float(len(completion) % 2 == 0)

      def hard(completion, example):
        assert example["source"] == "hard", example["source"]
        return float(sum(ch.isdigit() for ch in completion) > 0)

      def vowels(completion, example):
        letters = [ch for ch in completion.lower() if ch.isalpha()]
        return sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0
  """))
  monkeypatch.setenv("PYTHONPATH", str(mod) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.syspath_prepend(str(mod))
  return "route_verifiers"


def _cli(capsys, tmp_path, *overrides):
  from rljax import cli
  smoke = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py")
  rc = cli.main(["train", "--config", smoke, f"--config.output.dir={tmp_path / 'run'}", "--config.train.steps=2",
                 "--config.output.progress=False", "--config.data.max_prompt_tokens=32", *overrides])
  return rc, capsys.readouterr().err


def test_cli_two_source_mixture_routes_and_refuses_the_unrouted_config(tmp_path, capsys, route_module):
  m = route_module
  sources = (f"--config.data.sources=[{{'kind': 'arithmetic', 'label': 'easy', 'verifier': '{m}:easy'}}, "
             f"{{'kind': 'arithmetic', 'label': 'hard', 'difficulty': 2, 'verifier': '{m}:hard'}}]")
  # Unrouted: one fixed verifier for both sources is refused before anything is built.
  fixed = f"--config.rewards.components=[{{'name': 'correct', 'verifier': '{m}:easy'}}]"
  rc, err = _cli(capsys, tmp_path, sources, fixed)
  assert rc == 1 and "Traceback" not in err
  assert "data.sources[1].verifier='route_verifiers:hard' (source 'hard') is not used by any reward component" in err
  assert "'verifier': 'by_source'" in err and "'sources': ['hard']" in err
  assert not (tmp_path / "run").exists()
  # Routed: by_source for correctness, plus a component restricted to one source.
  components = (f"--config.rewards.components=[{{'name': 'correct', 'verifier': 'by_source'}}, "
                f"{{'name': 'vowels', 'verifier': '{m}:vowels', 'weight': 0.5, 'sources': ['hard']}}]")
  rc, err = _cli(capsys, tmp_path, sources, components)
  assert rc == 0, err[-3000:]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert len(rows) == 2
  for r in rows:
    assert r["verifier/errors"] == 0 and r["verifier/failures"] == 0    # no row met the other source's verifier
    for label in ("easy", "hard"):
      assert f"reward/source/{label}/mean" in r and f"reward/source/{label}/accuracy" in r
    assert "reward/vowels_mean" in r and "reward/vowels_pass" in r
    # The mixture is half and half (weights 1:1), so each source's mean weighs half of reward/mean.
    assert r["reward/mean"] == pytest.approx((r["reward/source/easy/mean"] + r["reward/source/hard/mean"]) / 2)
