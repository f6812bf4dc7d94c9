"""The device check's results as JSON and as Markdown tables, written atomically after every part."""
from __future__ import annotations

import json
import math
import os


def _fmt(v) -> str:
  if isinstance(v, bool) or v is None:
    return str(v)
  if isinstance(v, int):
    return f"{v:,}"
  if isinstance(v, float):
    if not math.isfinite(v):
      return str(v)
    if v == 0:
      return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
      return f"{v:.3g}"
    return f"{v:.4g}"
  return str(v)


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(results: dict) -> str:
  env = next((r["values"] for p in results["parts"] if p["name"] == "env" for r in p["rows"]
              if r["check"] == "device"), None) or results.get("device") or {}
  device = (f"{env.get('devices', '?')} x {env.get('device_kind', '?')} ({env.get('platform', '?')})" if env
            else "device not recorded")
  lines = [f"rljax device check, {results['mode']} mode, started {results['started']}: {device}; "
           f"jax {env.get('jax', '?')}; host {results['host']}, Python {results['python']}; "
           f"budget {results['budget_s']:.0f} s"
           + (f", finished in {results['seconds']:.0f} s." if results.get("finished") else ", still running."), ""]
  inst = results.get("install") or {}
  lines += [f"Install of the carried wheels: {inst.get('status', '?')}"
            + (f" ({inst['note']})" if inst.get("note") else "")
            + (f", {inst['seconds']:.0f} s" if isinstance(inst.get("seconds"), (int, float)) else ""), ""]
  lines += ["| part | status | seconds |", "| --- | --- | --- |"]
  lines += [f"| {p['name']} | {p['status']} | {p['seconds']:.0f} |" for p in results["parts"]]
  lines += ["", "| part | check | status | result | note |", "| --- | --- | --- | --- | --- |"]
  for p in results["parts"]:
    for r in p["rows"]:
      values = ", ".join(f"{k} {_fmt(v)}" for k, v in r["values"].items())
      lines.append(f"| {p['name']} | {_cell(r['check'])} | {r['status']} | {_cell(values)} | {_cell(r['note'])} |")
  return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def write(out: str, results: dict) -> None:
  _write(os.path.join(out, "results.json"), json.dumps(results, indent=1, sort_keys=False) + "\n")
  _write(os.path.join(out, "results.md"), markdown(results))
