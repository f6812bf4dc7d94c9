"""Procedural tasks: determinism, difficulty, reachability, train/held-out separation."""
import ast
import collections
import fractions
import operator

import pytest

from rljax.data import ArithmeticTask, CountdownTask, build_dataset, is_held_out
from rljax.errors import ConfigError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_exact(expression):
  """Evaluates + - * / over integer literals exactly; returns (value, literals used)."""
  used = []

  def walk(node):
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](walk(node.left), walk(node.right))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
      used.append(node.value)
      return fractions.Fraction(node.value)
    raise ValueError(f"unexpected syntax in {expression!r}")

  return walk(ast.parse(expression, mode="eval").body), used


def test_arithmetic_is_deterministic_and_random_access():
  a = ArithmeticTask(seed=7, difficulty=2, split="train", num_examples=None)
  b = ArithmeticTask(seed=7, difficulty=2, split="train", num_examples=None)
  forward = [a.read(i) for i in range(50)]
  backward = [b.read(i) for i in reversed(range(50))][::-1]
  assert forward == backward
  other_seed = [ArithmeticTask(seed=8, difficulty=2, split="train", num_examples=None).read(i) for i in range(50)]
  assert forward != other_seed


@pytest.mark.parametrize("difficulty,num_ops,max_operand", [(1, 1, 9), (2, 1, 99), (3, 2, 999), (5, 3, 99999)])
def test_arithmetic_difficulty_and_answers(difficulty, num_ops, max_operand):
  task = ArithmeticTask(seed=0, difficulty=difficulty, split="train", num_examples=None)
  for i in range(100):
    row = task.read(i)
    value, operands = _eval_exact(row["expression"])
    assert row["answer"] == str(int(value))
    assert row["question"] == f"What is {row['expression']}?"
    assert len(operands) == num_ops + 1 and max(operands) <= max_operand


@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_countdown_target_is_reachable_by_construction(difficulty):
  task = CountdownTask(seed=1, difficulty=difficulty, split="train", num_examples=None)
  for i in range(100):
    row = task.read(i)
    assert len(row["numbers"]) == difficulty + 2
    assert all(1 <= n <= 99 for n in row["numbers"]) and 1 <= row["target"] <= 999
    value, used = _eval_exact(row["answer"])
    assert value == row["target"]
    assert collections.Counter(used) == collections.Counter(row["numbers"])  # each number exactly once


@pytest.mark.parametrize("task_cls,difficulty", [(ArithmeticTask, 1), (CountdownTask, 1)])
def test_held_out_never_overlaps_train(task_cls, difficulty):
  # Difficulty 1 arithmetic has only 300 distinct problems, so seeds alone could not separate splits.
  train = {task_cls(seed=s, difficulty=difficulty, split="train", num_examples=None).read(i)["canonical"]
           for s in (0, 1) for i in range(600)}
  test = {task_cls(seed=s, difficulty=difficulty, split="test", num_examples=None).read(i)["canonical"]
          for s in (0, 1) for i in range(200)}
  assert train and test and not train & test
  assert all(is_held_out(c) for c in test) and not any(is_held_out(c) for c in train)


def test_procedural_sources_in_build_dataset():
  cfg = {"sources": [{"kind": "countdown", "difficulty": 2, "num_examples": 20, "seed": 5,
                      "prompt_template": "{prompt} Numbers again: {numbers}."}], "num_epochs": 1, "shuffle": False}
  ds = build_dataset(cfg)
  assert len(ds) == 20
  ex = ds[3]
  assert ex["verifier"] == "countdown" and ex["id"] == "countdown:train:3"
  assert ex["prompt"].endswith(f"Numbers again: {ex['numbers']}.")
  assert isinstance(ex["target"], int) and ex["answer"]
  held = build_dataset(cfg, split="test")
  assert not {ds[i]["prompt"] for i in range(20)} & {held[i]["prompt"] for i in range(20)}
  endless = build_dataset({"sources": [{"kind": "arithmetic"}]})
  assert not endless.is_finite and endless[10**9]["answer"]


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_held_out_fraction_sets_the_share_of_distinct_problems(share):
  def distinct(split):
    task = ArithmeticTask(seed=0, difficulty=1, split=split, num_examples=None, held_out_fraction=share)
    return {task.read(i)["canonical"] for i in range(3000)}
  train, test = distinct("train"), distinct("test")
  assert not train & test and len(train | test) == 300      # every one-digit problem, in exactly one split
  # Buckets are a hash, so the realised share wanders around the nominal one: 300 problems give a
  # binomial standard deviation of at most 0.029; allow 3 of them.
  assert abs(len(test) / 300 - share) < 0.09, len(test)
  assert all(is_held_out(c, share) for c in test) and not any(is_held_out(c, share) for c in train)


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0, "half", True])
def test_held_out_fraction_must_be_a_sixteenth_multiple(share):
  with pytest.raises(ConfigError, match=r"held_out_fraction=.*multiple of 1/16"):
    build_dataset({"sources": [{"kind": "arithmetic", "held_out_fraction": share}]})


def test_held_out_fraction_is_only_for_procedural_sources(tmp_path):
  with pytest.raises(ConfigError, match="held_out_fraction"):
    build_dataset({"sources": [{"kind": "jsonl", "path": str(tmp_path / "x.jsonl"), "held_out_fraction": 0.5}]})
