"""Throughput of the reward pool: rewards/s for math and code items, and the pool's overhead
per item against calling the verifier inline.

    python scripts/bench_rewards.py                  # 1,000 math items, 200 code items, 2 workers
    python scripts/bench_rewards.py --math 200 --code 50 --workers 4
    python scripts/bench_rewards.py --overhead-only  # the pool's per-item overhead, and a fork per item

The per-item overhead is the pool's time minus calling the verifier inline: with `noop` it is
all overhead (scheduling, the request and reply, the worker's per-item sweep and process-state
check). "fork per item" times the other way to isolate items, a fresh fork of a process that
holds the verifier for every item (rljax checks and recycles workers instead: docs/rewards.md).

Completions are all distinct (the math verifier caches parses per worker, so repeating one
string would flatter it). Code items run 3 stdin/stdout tests each in the sandbox.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchlib import Result, add_json_arg, report  # noqa: E402

from rljax.rewards import RewardPool, RewardSpec  # noqa: E402


def math_items(n: int) -> tuple[list[str], list[dict]]:
  completions, examples = [], []
  for i in range(n):
    p, q = i + 1, i + 2
    forms = [
        f"We simplify and get \\boxed{{\\frac{{{p}}}{{{q}}}}}.",
        f"The answer is $\\dfrac{{{2 * p}}}{{{2 * q}}}$.",
        f"So the result is {p / q:.10f}",
        f"\\boxed{{\\frac{{{q}}}{{{p}}}}}",                       # wrong
        f"<think>...</think> the final answer: \\boxed{{{p}/{q} + 1}}",  # wrong
    ]
    completions.append(forms[i % len(forms)])
    examples.append({"answer": f"\\frac{{{p}}}{{{q}}}"})
  return completions, examples


def code_items(n: int) -> tuple[list[str], list[dict]]:
  completions, examples = [], []
  for i in range(n):
    k = i % 7 + 1
    right = i % 4 != 3
    body = f"print(sum(map(int, input().split())) * {k if right else k + 1})"
    completions.append(f"Here is my solution #{i}:\n```python\n{body}\n```")
    tests = [{"input": f"{a} {a + i}\n", "output": f"{(2 * a + i) * k}\n"} for a in (1, 5, 9)]
    examples.append({"tests": tests})
  return completions, examples


def timed(pool: RewardPool, completions, examples, repeats: int = 1) -> tuple[float, dict]:
  best, metrics = float("inf"), {}
  for _ in range(repeats):
    start = time.perf_counter()
    out = pool.score(completions, examples)
    best = min(best, time.perf_counter() - start)
    metrics = out.metrics
  return best, metrics


def spec(verifier: str, workers: int, kwargs: dict | None = None) -> RewardSpec:
  return RewardSpec.from_dict({"components": [{"name": "r", "verifier": verifier, "kwargs": kwargs or {}}],
                               "num_workers": workers, "timeout_s": 30.0, "batch_deadline_s": 600.0})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--math", type=int, default=1000, help="math items")
  parser.add_argument("--code", type=int, default=200, help="code items (3 tests each)")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--overhead-items", type=int, default=2000)
  parser.add_argument("--overhead-only", action="store_true", help="skip the math and code throughput")
  add_json_arg(parser)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  print(f"machine: {os.cpu_count()} CPUs; workers: {args.workers}")

  results = [] if args.overhead_only else throughput(args)
  results += overhead(args)
  report(results, args.json)
  return 0


def throughput(args) -> list[Result]:
  comps, exs = math_items(args.math)
  with RewardPool(spec("math", args.workers)) as pool:
    pool.score(*math_items(4))  # first-call costs (sympy caches in fresh workers) outside the timing
    t, m = timed(pool, comps, exs)
  math_rate = args.math / t
  print(f"math  {args.math:5d} items, {args.workers} workers: {t:7.2f} s  {args.math / t:8.1f} rewards/s "
        f"(accuracy {m['reward/accuracy']:.2f}, failures {m['verifier/failures']:.0f})")
  with RewardPool(spec("math", 0)) as pool:
    pool.score(*math_items(4))  # import math-verify outside the timing
    t_inline, _ = timed(pool, comps, exs)
  results = [Result(f"reward pool, {args.math} `math` items, {args.workers} workers: rewards/s", f"{math_rate:.0f}",
                    f"inline calls {args.math / t_inline:.0f}", f"{math_rate * t_inline / args.math:.2f}x")]
  print(f"math  {args.math:5d} items, inline   : {t_inline:7.2f} s  {args.math / t_inline:8.1f} rewards/s")

  comps, exs = code_items(args.code)
  with RewardPool(spec("code", args.workers)) as pool:
    t, m = timed(pool, comps, exs)
  results.append(Result(f"reward pool, {args.code} `code` items (3 sandboxed tests each): rewards/s",
                        f"{args.code / t:.1f}"))
  print(f"code  {args.code:5d} items, {args.workers} workers: {t:7.2f} s  {args.code / t:8.1f} rewards/s "
        f"(3 sandboxed runs per item; accuracy {m['reward/accuracy']:.2f}, failures {m['verifier/failures']:.0f})")
  return results


def overhead(args) -> list[Result]:
  results = []
  # Overhead per item: the same items inline and through the pool. With `noop` (a verifier
  # that does nothing) the pool's time is all overhead: scheduling, pickling, IPC.
  n = args.overhead_items
  comps = [f"7 - 3 = {4 + (i % 2)} and some padding text {i}" for i in range(n)]
  exs = [{"answer": "4"}] * n
  us = lambda t: 1e6 * t / n  # noqa: E731
  for verifier in ("__main__:noop", "arithmetic"):
    times = {}
    for workers in (0, 1, args.workers):
      with RewardPool(spec(verifier, workers)) as pool:
        times[workers], _ = timed(pool, comps, exs, repeats=3)
    name = verifier.split(":")[-1]
    print(f"overhead {name:10s} ({n} items): inline {us(times[0]):6.1f} us/item; pool with 1 worker "
          f"{us(times[1]):6.1f} us/item (+{us(times[1]) - us(times[0]):.1f}); with {args.workers} workers "
          f"{us(times[args.workers]):6.1f} us/item")
    results.append(Result(f"reward pool overhead per item, `{name}` verifier, 1 worker",
                          f"+{us(times[1]) - us(times[0]):.0f} us over inline"))
    forked = fork_per_item(verifier, comps[:200], exs[:200])
    print(f"  a fresh fork per item instead ({name}): {forked:8.1f} us/item (+{forked - us(times[0]):.1f} over inline)")
    results.append(Result(f"isolating items by a fork per item instead, `{name}` verifier",
                          f"+{forked - us(times[0]):.0f} us over inline"))
  return results


def fork_per_item(verifier: str, comps: list[str], exs: list[dict]) -> float:
  """us per item when every item runs in a fresh fork of this process (the verifier imported)."""
  from rljax.rewards import get_verifier
  fn = get_verifier(verifier).fn
  fn(comps[0], exs[0])
  start = time.perf_counter()
  for c, e in zip(comps, exs):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
      try:
        os.close(r)
        os.write(w, repr(fn(c, e)).encode())
      finally:
        os._exit(0)
    os.close(w)
    os.read(r, 4096)
    os.close(r)
    os.waitpid(pid, 0)
  return 1e6 * (time.perf_counter() - start) / len(comps)


def noop(completion: str, example) -> float:
  """A verifier that costs nothing (for measuring the pool's own overhead)."""
  return 0.0


if __name__ == "__main__":
  sys.exit(main())
