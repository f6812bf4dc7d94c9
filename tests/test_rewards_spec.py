"""RewardSpec validation, the verifier registry, composition (weights, gates, schedules)."""
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.rewards import (
  RewardPool,
  RewardResult,
  RewardSpec,
  get_verifier,
  normalize_result,
  register_verifier,
  weight_at,
)
from rljax.rewards.compose import combine


@register_verifier("test_len_bonus")
def len_bonus(completion, example):
  """1.0 for completions shorter than 10 characters."""
  return float(len(completion) < 10)


@register_verifier("test_group_rank", kind="group")
def group_rank(completions, example, *, scale: float = 1.0):
  """Score = scale * rank of the completion's length within its group."""
  order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
  ranks = [0] * len(completions)
  for r, i in enumerate(order):
    ranks[i] = r
  return [scale * r for r in ranks]


@register_verifier("test_batch_echo", kind="batch")
def batch_echo(completions, examples, *, num_tokens=None, step=0):
  return [RewardResult(float(t) + step, {"n": len(completions)}) for t in num_tokens]


def _spec(**kw):
  base = {"components": [{"name": "correct", "verifier": "arithmetic"}], "num_workers": 0}
  base.update(kw)
  return RewardSpec.from_dict(base)


def test_from_dict_and_defaults():
  spec = _spec()
  assert spec.timeout_s == 5.0 and spec.fallback == 0.0 and spec.components[0].weight == 1.0
  assert spec.to_dict()["components"][0]["name"] == "correct"
  assert spec.component_names == ["correct"]


@pytest.mark.parametrize("bad,match", [
    ({"timeout": 3}, "unknown field.*timeout"),
    ({"components": [{"name": "x", "verifier": "nope"}]}, "unknown verifier 'nope'"),
    ({"components": [{"name": "x", "verifier": "arithmetic", "wieght": 1}]}, "unknown field.*wieght"),
    ({"components": [{"name": "x"}]}, "missing 'verifier'"),
    ({"components": []}, "empty"),
    ({"components": [{"name": "x", "verifier": "math"}, {"name": "x", "verifier": "gsm8k"}]}, "unique"),
    ({"components": [{"name": "x", "verifier": "math", "gate": "y"}]}, "gate 'y'"),
    ({"components": [{"name": "x", "verifier": "math", "gate": "x"}]}, "itself"),
    ({"components": [{"name": "a", "verifier": "math", "gate": "b"}, {"name": "b", "verifier": "math", "gate": "a"}]},
     "cycle"),
    ({"components": [{"name": "x", "verifier": "math", "kwargs": {"tolerance": 1}}]},
     "no keyword argument 'tolerance'"),
    ({"components": [{"name": "x", "verifier": "overlong", "kwargs": {"max_len": 8, "buffer": 16}}]}, "buffer"),
    ({"components": [{"name": "x", "verifier": "format", "kwargs": {"pattern": "("}}]}, "regex"),
    ({"components": [{"name": "x", "verifier": "math", "weight": {"type": "cosine"}}]}, "weight.type"),
    ({"components": [{"name": "x", "verifier": "math", "weight": {"type": "linear", "init": 1}}]}, "end"),
    ({"components": [{"name": "x", "verifier": "math", "weight": {"type": "piecewise", "boundaries": [1],
                                                                 "values": [1]}}]}, "len\\(values\\)"),
    ({"components": [{"name": "x", "verifier": "no_such_module_xyz:fn"}]}, "cannot import"),
    ({"components": [{"name": "x", "verifier": "rljax.rewards.base:nothing"}]}, "no attribute"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"num_workers": -1}, "num_workers"),
    ({"max_memory_mb": 16}, "max_memory_mb"),
    ({"fallback": float("nan")}, "fallback"),
])
def test_validation_names_the_field(bad, match):
  base = {"components": [{"name": "correct", "verifier": "arithmetic"}]}
  base.update(bad)
  with pytest.raises(ConfigError, match=match):
    RewardSpec.from_dict(base)


def test_registry_and_import_paths():
  assert get_verifier("test_len_bonus").fn is len_bonus
  assert get_verifier("test_group_rank").kind == "group"
  v = get_verifier("rljax.rewards.verifiers.gsm8k:gsm8k_verifier")
  assert v.fn("#### 3", {"answer": "3"}).score == 1.0
  assert get_verifier(len_bonus).fn is len_bonus
  with pytest.raises(ConfigError, match="already registered"):
    register_verifier("test_len_bonus", lambda c, e: 0.0)
  register_verifier("test_len_bonus", len_bonus)  # the same function again is fine


def test_normalize_result():
  assert normalize_result(True) == (1.0, None)
  assert normalize_result(np.float32(0.5)) == (0.5, None)
  assert normalize_result(RewardResult(1, {"a": 1})) == (1.0, {"a": 1})
  for bad in ["1", None, [1.0], float("inf")]:
    with pytest.raises((TypeError, ValueError)):
      normalize_result(bad)


def test_schedules():
  lin = {"type": "linear", "init": 1.0, "end": 0.0, "begin_step": 10, "end_step": 20}
  assert [weight_at(lin, s) for s in (0, 10, 15, 20, 99)] == [1.0, 1.0, 0.5, 0.0, 0.0]
  pw = {"type": "piecewise", "boundaries": [5, 10], "values": [0.0, 0.5, 1.0]}
  assert [weight_at(pw, s) for s in (0, 4, 5, 9, 10, 100)] == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
  assert weight_at({"type": "constant", "value": 2}, 7) == 2.0
  assert weight_at(lambda s: s / 10, 5) == 0.5


def test_combine_weights_and_gates():
  spec = RewardSpec(components=[
      {"name": "correct", "verifier": "arithmetic", "weight": 1.0},
      {"name": "short", "verifier": "test_len_bonus", "weight": 0.5, "gate": "correct"},
      {"name": "fmt", "verifier": "format", "weight": {"type": "linear", "init": 1.0, "end": 0.0, "end_step": 10}},
  ], num_workers=0)
  spec.validate()
  scores = np.array([[1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 0, 0]], float)
  failed = np.zeros_like(scores, bool)
  failed[0, 3] = True  # a failed gate does not open, whatever its fallback score
  rewards, passed = combine(spec, scores, failed, step=5)
  np.testing.assert_allclose(rewards, [1 + 0.5 + 0.5, 0 + 0 + 0.5, 1 + 0 + 0, 1 + 0 + 0])
  assert passed[1].tolist() == [True, False, False, False]


def test_accuracy_is_reported_only_for_pass_fail_scores():
  """reward/accuracy is a pass rate: a continuous score (the smoke recipe's vowel fraction) would
  read 1.0 whenever it is above 0, so it is not reported then; pass/fail scores report it."""
  from rljax.rewards.compose import batch_metrics
  spec = RewardSpec(components=[{"name": "correct", "verifier": "arithmetic", "weight": 1.0}], num_workers=0)
  spec.validate()
  for scores, want in (([[1.0, 0.0, 1.0, 1.0]], 0.75), ([[0.3, 0.5, 0.2, 0.9]], None)):
    scores = np.asarray(scores)
    rewards, passed = combine(spec, scores, np.zeros_like(scores, bool), step=0)
    m = batch_metrics(spec, rewards, scores, passed, [[None] * 4], step=0)
    assert m.get("reward/accuracy") == want


def test_inline_pool_scores_all_kinds_and_metrics():
  spec = RewardSpec.from_dict({"components": [
      {"name": "correct", "verifier": "arithmetic"},
      {"name": "short", "verifier": "test_len_bonus", "weight": 0.5, "gate": "correct"},
      {"name": "rank", "verifier": "test_group_rank", "weight": 0.0, "kwargs": {"scale": 2.0}},
      {"name": "echo", "verifier": "test_batch_echo", "weight": 0.0},
      {"name": "overlong", "verifier": "overlong", "kwargs": {"max_len": 10, "buffer": 4}},
  ], "num_workers": 0})
  with RewardPool(spec) as pool:
    out = pool.score(["4", "The answer is 4, a long one", "5 is it, long text", "zz"],
                     [{"answer": "4"}, {"answer": "5"}], num_tokens=[1, 7, 8, 12], group_size=2, step=3)
  np.testing.assert_allclose(out.components["correct"], [1, 1, 1, 0])
  np.testing.assert_allclose(out.components["short"], [1, 0, 0, 1])
  np.testing.assert_allclose(out.components["rank"], [0, 2, 2, 0])
  np.testing.assert_allclose(out.components["echo"], [4, 10, 11, 15])
  np.testing.assert_allclose(out.components["overlong"], [0, -0.25, -0.5, -1])
  np.testing.assert_allclose(out.rewards, [1.5, 0.75, 0.5, -1.0])
  assert out.metrics["reward/accuracy"] == 0.75
  assert out.metrics["reward/correct_mean"] == 0.75
  assert out.metrics["info/echo/n"] == 4
  assert out.answers[:3] == ["4", "4", "5"]
  assert out.components_matrix().shape == (4, 5)


def test_score_argument_errors():
  with RewardPool(_spec(components=[{"name": "o", "verifier": "overlong",
                                     "kwargs": {"max_len": 4, "buffer": 2}}])) as pool:
    with pytest.raises(ValueError, match="num_tokens"):
      pool.score(["a"], [{}])
    with pytest.raises(ValueError, match="examples"):
      pool.score(["a", "b", "c"], [{}, {}], num_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="group_size"):
      pool.score(["a", "b", "c"], [{}] * 3, num_tokens=[1, 2, 3], group_size=2)
