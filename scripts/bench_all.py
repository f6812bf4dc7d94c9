"""Runs every benchmark and writes one Markdown table of the results.

    pip install -e '.[bench]' && python scripts/bench_all.py --out benchmarks.md

Each benchmark runs in its own process (so one's memory and threads do not affect the next)
and reports rows of (benchmark, rljax, peer, ratio); the table starts with the machine and date.
Takes about 30 minutes on a 2-core CPU, most of it the full-step comparison with TRL.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlib import Result, machine, markdown  # noqa: E402

BENCHMARKS = ("bench_forward.py", "bench_generate.py", "bench_rewards.py", "bench_logprobs_memory.py",
              "bench_rollouts.py", "bench_partial.py", "bench_multiturn.py", "bench_step.py")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="benchmarks.md")
  p.add_argument("--only", nargs="*", default=None, help="a subset of: " + " ".join(BENCHMARKS))
  args = p.parse_args(argv)
  results, failed = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for script in args.only or BENCHMARKS:
      path = os.path.join(tmp, script + ".json")
      print(f"== {script}", flush=True)
      proc = subprocess.run([sys.executable, os.path.join(HERE, script), "--json", path])
      if proc.returncode != 0 or not os.path.exists(path):
        failed.append(script)
        continue
      with open(path) as f:
        results += [Result(**r) for r in json.load(f)]
  text = f"Machine: {machine()}\n\n{markdown(results)}\n"
  if failed:
    text += f"\nFailed (see their output above): {', '.join(failed)}\n"
  with open(args.out, "w") as f:
    f.write(text)
  print(f"\n{text}\nwritten to {args.out}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
