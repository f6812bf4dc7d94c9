"""`code`: runs the completion's Python code against test cases in the subprocess sandbox.

Test cases come from the example:
  stdin/stdout  "tests": [{"input": "...", "output": "..."}, ...]
                (or "inputs" / "outputs" lists); one sandboxed run per case.
  assert-style  "asserts" (or "test_list"): ["assert f(1) == 2", ...], with optional
                "setup" (or "test_setup_code"); or "test" (code defining check(candidate))
                with "entry_point". One sandboxed run executes every assert after the code.

The code is the last ```python fenced block (else the last fenced block, else the
<answer> content, else the whole completion). See rljax/rewards/sandbox.py for how the
sandbox isolates the code, and docs/rewards.md for the table of what it can and cannot do.
"""
from __future__ import annotations

import re
import secrets
from typing import Any, Mapping, Sequence

from rljax.rewards import sandbox
from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import answer_tag

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
  """The Python code in a completion (see the module doc)."""
  blocks = _FENCE.findall(completion)
  py = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
  if py:
    return py[-1]
  if blocks:
    return blocks[-1][1]
  if "```" in completion:  # an unterminated fence: take what follows it
    return completion.rsplit("```", 1)[1].split("\n", 1)[-1]
  tagged = answer_tag(completion)
  return tagged if tagged is not None else completion


def outputs_match(got: str, want: str, compare: str = "tokens") -> bool:
  """Compares program output: 'tokens' (whitespace-insensitive), 'lines' (trailing spaces
  ignored) or 'exact'."""
  if compare == "exact":
    return got == want
  if compare == "lines":
    norm = lambda s: [ln.rstrip() for ln in s.rstrip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)
  return got.split() == want.split()


def _stdio_tests(example: Mapping[str, Any]) -> list[tuple[str, str]] | None:
  if "tests" in example and isinstance(example["tests"], Sequence) and not isinstance(example["tests"], str):
    out = []
    for t in example["tests"]:
      if not isinstance(t, Mapping):
        raise ValueError("example['tests'] items must be dicts with 'input' and 'output'")
      out.append((str(t.get("input", t.get("stdin", ""))), str(t.get("output", t.get("stdout", "")))))
    return out
  if "inputs" in example and "outputs" in example:
    return [(str(i), str(o)) for i, o in zip(example["inputs"], example["outputs"])]
  return None


def _assert_tests(example: Mapping[str, Any]) -> tuple[list[str], str] | None:
  setup = str(example.get("setup", example.get("test_setup_code", "")) or "")
  for key in ("asserts", "test_list"):
    if key in example:
      tests = example[key]
      return ([tests] if isinstance(tests, str) else [str(t) for t in tests]), setup
  if "test" in example:
    test = str(example["test"])
    if example.get("entry_point"):
      test += f"\ncheck({example['entry_point']})\n"
    return [test], setup
  return None


_HARNESS = '''

def __rljax_run_tests():
  import sys
  results = []
  for src in {tests!r}:
    try:
      exec(compile(src, "<test>", "exec"), globals())
      results.append("1")
    except BaseException:
      results.append("0")
  sys.stdout.flush()
  sys.stdout.write("\\n{nonce} " + "".join(results) + "\\n")
  sys.stdout.flush()

{setup}
__rljax_run_tests()
'''


def code_verifier(completion: str, example: Mapping[str, Any], *, timeout_s: float = 2.0,
                  total_timeout_s: float | None = None, memory_mb: int = 512, partial_credit: bool = False,
                  compare: str = "tokens", max_tests: int | None = None, max_processes: int = 16,
                  network: bool = False) -> RewardResult:
  """Fraction of passed tests with partial_credit, else 1.0 only when every test passes.

  Args:
    timeout_s: wall-clock limit of each sandboxed run (one per stdin/stdout case; one for
      all asserts).
    total_timeout_s: budget for all runs of the item; later cases count as failed. Keep it
      (or timeout_s * cases) below the pool's timeout_s, or the whole item falls back.
    memory_mb, max_processes, network: sandbox limits (see SandboxLimits).
    compare: 'tokens', 'lines' or 'exact' output comparison.
    max_tests: use only the first max_tests cases.
  """
  code = extract_code(completion)
  limits = sandbox.SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes,
                                 network=network)
  stdio = _stdio_tests(example)
  if stdio is not None:
    cases = stdio[:max_tests] if max_tests else stdio
    if not cases:
      raise ValueError("example has an empty test list")
    passed, timeouts, spent = 0, 0, 0.0
    for given, want in cases:
      if total_timeout_s is not None and spent >= total_timeout_s:
        break
      run_limits = limits
      if total_timeout_s is not None:
        run_limits = sandbox.SandboxLimits(**{**limits.__dict__,
                                              "timeout_s": min(timeout_s, total_timeout_s - spent)})
      res = sandbox.run_python(code, stdin=given, limits=run_limits)
      spent += res.duration_s
      timeouts += res.timed_out
      ok = res.ok and outputs_match(res.stdout, want, compare)
      passed += ok
      if not ok and not partial_credit:
        break
    total = len(cases)
  else:
    found = _assert_tests(example)
    if found is None:
      raise KeyError("code example needs 'tests' (stdin/stdout), 'inputs'/'outputs', 'asserts', 'test_list' "
                     f"or 'test' (fields: {sorted(example)})")
    tests, setup = found
    tests = tests[:max_tests] if max_tests else tests
    nonce = secrets.token_hex(16)
    program = code + _HARNESS.format(tests=tests, nonce=nonce, setup=setup)
    res = sandbox.run_python(program, limits=limits)
    timeouts = int(res.timed_out)
    total, passed = len(tests), 0
    if res.ok:
      lines = [ln for ln in res.stdout_tail.splitlines() if ln.startswith(nonce + " ")]
      if lines:
        flags = lines[-1].split(" ", 1)[1].strip()
        passed = flags.count("1") if len(flags) == total else 0
  score = passed / total if partial_credit else float(passed == total)
  return RewardResult(score, {"passed": passed / total, "timeouts": float(timeouts)})


def _check(timeout_s: float = 2.0, total_timeout_s: float | None = None, memory_mb: int = 512,
           partial_credit: bool = False, compare: str = "tokens", max_tests: int | None = None,
           max_processes: int = 16, network: bool = False) -> None:
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
  if compare not in ("tokens", "lines", "exact"):
    raise ValueError(f"compare must be 'tokens', 'lines' or 'exact', got {compare!r}")
  if memory_mb < 64:
    raise ValueError(f"memory_mb must be >= 64, got {memory_mb}")


code_verifier.check_config = _check
register_verifier("code", code_verifier, warmup=sandbox.isolation)
