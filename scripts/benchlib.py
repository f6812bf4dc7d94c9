"""The benchmarks' shared report format: rows of (benchmark, rljax, peer, ratio) as Markdown.

Every `scripts/bench_*.py` ends by calling `report(results, args.json)`: it prints the rows as a
Markdown table and, with `--json PATH`, writes them for `scripts/bench_all.py` to collect.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform


@dataclasses.dataclass
class Result:
  benchmark: str
  rljax: str
  peer: str = "-"
  ratio: str = "-"      # rljax relative to the peer, stated with its direction ("1.4x faster")


def add_json_arg(parser) -> None:
  parser.add_argument("--json", default="", help="also write the result rows to this JSON file")


def markdown(results: list[Result]) -> str:
  lines = ["| benchmark | rljax | peer | ratio |", "| --- | --- | --- | --- |"]
  lines += [f"| {r.benchmark} | {r.rljax} | {r.peer} | {r.ratio} |" for r in results]
  return "\n".join(lines)


def report(results: list[Result], json_path: str = "") -> list[Result]:
  print(markdown(results))
  if json_path:
    with open(json_path, "w") as f:
      json.dump([dataclasses.asdict(r) for r in results], f)
  return results


def machine() -> str:
  """One line: CPU model and cores, memory, accelerator, date."""
  model = platform.processor() or "cpu"
  try:
    with open("/proc/cpuinfo") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  mem = ""
  try:
    mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
  except (ValueError, OSError):
    pass
  import jax
  dev = jax.devices()[0]
  return (f"{model}, {os.cpu_count()} cores{mem}; JAX {jax.__version__} on {dev.platform} ({dev.device_kind}); "
          f"{datetime.date.today().isoformat()}")
