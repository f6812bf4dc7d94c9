"""The device check: every part in its own process under its own timeout, results after each part.

    python scripts/device/gpu_check.py --out DIR [--cpu] [--budget S] [--parts a,b] [--skip a,b]
    bash scripts/device/gpu_check.sh [--cpu] [--out DIR] ...     # the same, after installing .wheels/

Writes DIR/results.json, DIR/results.md (rewritten after every part, so a cut-off run keeps what it
measured) and DIR/log.txt (every part's output). A part that crashes, fails or outlives its timeout
gets a row that says so and the next part runs. --cpu: jax on the CPU, tiny shapes, the CUDA-only
checks recorded as skipped (tests/test_device_check.py runs it that way).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402
from checklib import ROOT, Context, Recorder, finite  # noqa: E402

# name, "module:function", timeout on the GPU (s), timeout with --cpu (s). In priority order: a run
# that is short of time drops the parts at the end (TRL's step, the least needed, is last). The GPU
# timeouts are what the first H100 run (2026-11-27, jax 0.11.2) needed, most of it compiling: there
# attention, logprobs and both speed parts outran 60/60/150/150 s after their first rows, and the
# whole table does not fit one 15-minute loan: name the parts a later loan still lacks with --parts.
# The CPU timeouts are loose: the tiny runs take 2-60 s each, but this 2-core machine is often shared.
PARTS = [
    ("env", "parts_env:env", 45, 240),
    ("attention", "parts_numerics:attention", 200, 240),
    ("logprobs", "parts_numerics:logprobs", 150, 240),
    ("sharded_step", "parts_training:sharded_step", 60, 240),
    ("smoke_train", "parts_training:smoke_train", 75, 240),
    ("speed_0.5b", "parts_speed:speed_05b", 200, 240),
    ("plan_memory", "parts_speed:plan_memory", 60, 240),
    ("speed_1.5b", "parts_speed:speed_15b", 200, 240),
    ("trl_grpo", "parts_trl:trl_grpo", 150, 240),
]
# Parts only tests/test_device_check.py asks for: they show a crash and a timeout being contained.
SELFTEST = [("selftest_crash", "parts_env:selftest_crash", 30, 30),
            ("selftest_hang", "parts_env:selftest_hang", 3, 3)]
MIN_START_S = 10   # a part is not started with less time than this left


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "device-check"),
                 help="results folder (default: $OUT, else runs/device-check)")
  p.add_argument("--cpu", action="store_true", help="jax on the CPU, tiny shapes, CUDA-only checks skipped")
  p.add_argument("--budget", type=float, default=None,
                 help="seconds for all parts together (default 660 on the GPU, 1200 with --cpu)")
  p.add_argument("--parts", default="", help="comma-separated part names to run (default: all)")
  p.add_argument("--skip", default="", help="comma-separated part names to leave out")
  p.add_argument("--timeout", action="append", default=[], metavar="PART=S", help="override a part's timeout")
  p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                 help="an option for the parts, e.g. speed_rows='[16, 64]' (see the parts' docstrings)")
  p.add_argument("--keep-work", action="store_true", help="keep the scratch folder (models, tokenizers, XLA cache)")
  p.add_argument("--run-part", default=None, help=argparse.SUPPRESS)     # internal: run one part here
  p.add_argument("--rows", default=None, help=argparse.SUPPRESS)
  p.add_argument("--context", default=None, help=argparse.SUPPRESS)
  return p


def _part_table(selected: str, skipped: str) -> list[tuple]:
  known = {p[0]: p for p in PARTS + SELFTEST}
  names = [n for n in selected.split(",") if n] or [p[0] for p in PARTS]
  unknown = [n for n in names + [n for n in skipped.split(",") if n] if n not in known]
  if unknown:
    raise SystemExit(f"gpu_check: unknown part(s) {unknown}; known: {sorted(known)}")
  drop = set(n for n in skipped.split(",") if n)
  return [known[n] for n in names if n not in drop]


def run_one_part(args) -> int:
  """The child side: import the part and run it, writing rows to args.rows."""
  with open(args.context, encoding="utf-8") as f:
    ctx = Context(**json.load(f))
  module, fn = dict((p[0], p[1]) for p in PARTS + SELFTEST)[args.run_part].split(":")
  rec = Recorder(args.run_part, args.rows)
  getattr(importlib.import_module(module), fn)(rec, ctx)
  return 0


def _child_env(cpu: bool, part: str, work: str) -> dict:
  env = dict(os.environ)
  # One compilation cache for the run: plan_memory compiles the programs speed_0.5b ran, and reads them
  # back instead of compiling them again (its compile_s is then the cache's).
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(work, "xla-cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env.setdefault("PYTHONUNBUFFERED", "1")
  env.setdefault("TOKENIZERS_PARALLELISM", "false")
  env.setdefault("HF_HUB_OFFLINE", "1")
  env.setdefault("TRANSFORMERS_OFFLINE", "1")
  if cpu:
    env["JAX_PLATFORMS"] = "cpu"
  if part == "sharded_step":   # 8 CPU devices for the (2, 2, 2) mesh; on the GPU machine beside the GPU
    flags = env.get("XLA_FLAGS", "")
    if "device_count" not in flags:
      env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    if not cpu:
      env["JAX_PLATFORMS"] = "cuda,cpu"
  return env


def _run_part(name: str, timeout: float, ctx_path: str, rows_path: str, log, cpu: bool,
              work: str) -> tuple[str, float, int]:
  """Runs one part in a new process group; returns (how it ended, seconds, exit code)."""
  cmd = [sys.executable, os.path.abspath(__file__), "--run-part", name, "--rows", rows_path, "--context", ctx_path]
  log.write(f"\n===== {name} (timeout {timeout:.0f} s) {datetime.datetime.now().isoformat(timespec='seconds')}\n")
  log.flush()
  t0 = time.time()
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(cpu, name, work), cwd=ROOT,
                          start_new_session=True)
  try:
    code = proc.wait(timeout=timeout)
    ended = "exited"
  except subprocess.TimeoutExpired:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):   # the part's own process group only
      try:
        os.killpg(proc.pid, sig)
      except ProcessLookupError:
        break
      try:
        proc.wait(timeout=grace)
        break
      except subprocess.TimeoutExpired:
        continue
    code = proc.returncode if proc.returncode is not None else -9
    ended = "timeout"
  seconds = time.time() - t0
  log.write(f"===== {name}: {ended}, exit code {code}, {seconds:.1f} s\n")
  log.flush()
  return ended, seconds, code


def _read_rows(path: str) -> list[dict]:
  rows = []
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        line = line.strip()
        if line:
          try:
            rows.append(json.loads(line))
          except json.JSONDecodeError:   # a line cut by a kill
            pass
  return rows


def part_status(ended: str, code: int, rows: list[dict]) -> str:
  """timeout | error (crashed, or an error row) | fail (a failed row) | skipped (every row skipped) | ok."""
  if ended == "timeout":
    return "timeout"
  statuses = {r["status"] for r in rows}
  if code != 0 or not rows or "error" in statuses:
    return "error"
  if "fail" in statuses:
    return "fail"
  if statuses == {"skipped"}:
    return "skipped"
  return "ok"


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.run_part:
    return run_one_part(args)
  parts = _part_table(args.parts, args.skip)
  timeouts = {}
  for item in args.timeout:
    name, _, secs = item.partition("=")
    timeouts[name] = float(secs)
  options = {}
  for item in args.option:
    key, _, value = item.partition("=")
    options[key] = json.loads(value)
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  budget = args.budget if args.budget is not None else (1200.0 if args.cpu else 660.0)
  start = time.time()
  work = tempfile.mkdtemp(prefix="rljax-device-check-")
  results = {"mode": "cpu" if args.cpu else "gpu", "started": datetime.datetime.now().isoformat(timespec="seconds"),
             "budget_s": budget, "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
             "python": platform.python_version(), "install": _install_record(), "device": _device_summary(args.cpu),
             "parts": [], "finished": False}
  report.write(out, results)
  with open(os.path.join(out, "log.txt"), "a", encoding="utf-8") as log:
    for name, _, gpu_s, cpu_s in parts:
      left = budget - (time.time() - start)
      timeout = min(timeouts.get(name, cpu_s if args.cpu else gpu_s), left)
      rows_path = os.path.join(work, f"{name}.rows.jsonl")
      if timeout < min(MIN_START_S, timeouts.get(name, cpu_s if args.cpu else gpu_s)):
        results["parts"].append({"name": name, "status": "skipped", "seconds": 0.0, "rows": [
            {"part": name, "check": "(not started)", "status": "skipped", "values": {},
             "note": f"out of time: {max(left, 0):.0f} s of the {budget:.0f} s budget left"}]})
        report.write(out, results)
        continue
      ctx_path = os.path.join(work, f"{name}.context.json")
      with open(ctx_path, "w", encoding="utf-8") as f:
        json.dump({"cpu": args.cpu, "options": options, "results_path": os.path.join(out, "results.json"),
                   "work_dir": work, "deadline": time.time() + timeout}, f)
      ended, seconds, code = _run_part(name, timeout, ctx_path, rows_path, log, args.cpu, work)
      rows = _read_rows(rows_path)
      if ended == "timeout":
        rows.append({"part": name, "check": "(timeout)", "status": "error", "values": {},
                     "note": f"killed after {timeout:.0f} s; the rows above finished before"})
      elif code != 0:
        rows.append({"part": name, "check": "(crash)", "status": "error", "values": {"exit_code": code},
                     "note": "the part's process failed; see log.txt"})
      results["parts"].append({"name": name, "status": part_status(ended, code, rows), "seconds": round(seconds, 1),
                               "rows": rows})
      report.write(out, results)
  results["finished"] = True
  results["seconds"] = round(time.time() - start, 1)
  report.write(out, results)
  if not args.keep_work:
    shutil.rmtree(work, ignore_errors=True)   # model directories, tokenizers, the compilation cache
  print(report.markdown(results))
  bad = [p["name"] for p in results["parts"] if p["status"] in ("error", "fail", "timeout")]
  nonfinite = [(r["part"], r["check"], k) for p in results["parts"] for r in p["rows"]
               for k, v in r["values"].items() if isinstance(v, float) and not finite(v)]
  print(f"gpu_check: {len(results['parts'])} parts in {results['seconds']:.0f} s; not ok: {bad or 'none'}"
        + (f"; non-finite values: {nonfinite}" if nonfinite else ""))
  return 1 if bad else 0


def _device_summary(cpu: bool) -> dict:
  """The device and jax version for the results' header when the env part does not run (short
  loans split runs by part), without importing jax here: this process must not hold the GPU."""
  import importlib.metadata
  try:
    version = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    version = "?"
  if cpu:
    return {"platform": "cpu", "devices": 1, "device_kind": platform.processor() or platform.machine(), "jax": version}
  try:
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30).stdout.split("\n")
  except (OSError, subprocess.SubprocessError):
    names = []
  names = [n.strip() for n in names if n.strip()]
  return {"platform": "gpu", "devices": len(names) or "?", "device_kind": names[0] if names else "?", "jax": version}


def _install_record() -> dict:
  """What gpu_check.sh recorded about installing the carried wheels (nothing when run directly)."""
  path = os.environ.get("GPU_CHECK_INSTALL_RECORD", "")
  if path and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  return {"status": "skipped", "note": "not run through gpu_check.sh"}


if __name__ == "__main__":
  sys.exit(main())
