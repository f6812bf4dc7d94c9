"""The prepared accelerator check (scripts/device/) run on this CPU, so it cannot rot between GPU loans.

`gpu_check.sh --cpu` runs every part with tiny shapes and records the CUDA-only checks as skipped;
the tests read the JSON and Markdown it writes. The self-test parts show that a part that crashes
or hangs is recorded with what it finished, and the next part still runs.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from rljax.errors import ConfigError
from rljax.plan import parse_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts", "device")
PARTS = ["env", "attention", "logprobs", "sharded_step", "smoke_train", "speed_0.5b", "plan_memory", "speed_1.5b",
         "trl_grpo"]


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)   # conftest's 8 simulated devices: the check sets them itself where a part needs them
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def _load(out):
  with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
    results = json.load(f)
  with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
    md = f.read()
  return results, md


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("device-check"))
  proc = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--cpu", "--out", out], env=_env(),
                        capture_output=True, text=True, timeout=1500, cwd=ROOT)
  return proc, out


def test_cpu_run_has_every_part_with_finite_numbers(cpu_check):
  proc, out = cpu_check
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results, md = _load(out)
  assert results["mode"] == "cpu" and results["finished"]
  assert [p["name"] for p in results["parts"]] == PARTS
  for part in results["parts"]:
    assert part["status"] in ("ok", "skipped"), part
    assert part["rows"], part["name"]
    for row in part["rows"]:
      assert row["status"] in ("ok", "skipped"), row
      assert row["status"] == "ok" or row["note"], row      # a skipped row says why
      for key, value in row["values"].items():
        assert not isinstance(value, str) or key in ("picked", "expected", "platform", "device_kind", "jax") \
            or part["name"] == "env", (part["name"], row["check"], key, value)   # non-finite numbers become strings
        if isinstance(value, float):
          assert math.isfinite(value), (part["name"], row["check"], key)
  # The Markdown has the parts table and one detail line per row.
  for part in results["parts"]:
    assert f"| {part['name']} | {part['status']} |" in md
  lines = md.splitlines()
  start = lines.index("| part | check | status | result | note |") + 2
  detail = [line for line in lines[start:] if line.startswith("| ")]
  assert len(detail) == sum(len(p["rows"]) for p in results["parts"])
  # At most 8 files come back from the device machine.
  assert sorted(os.listdir(out)) == ["log.txt", "results.json", "results.md"]


def test_cpu_run_measures_what_the_gpu_run_reports(cpu_check):
  results, _ = _load(cpu_check[1])
  parts = {p["name"]: p for p in results["parts"]}
  rows = lambda name: {r["check"]: r for r in parts[name]["rows"]}
  assert any(r["status"] == "skipped" and "CUDA" in r["note"] for r in parts["attention"]["rows"])
  assert rows("attention")["cudnn wrapping (xla impl) vs xla, bf16, padded rows"]["status"] == "ok"
  gaps = rows("logprobs")
  assert gaps["sampler vs learner log-probs, fp32, matmul precision highest"]["values"]["mean_abs_diff"] < 1e-4
  assert gaps["sampler vs learner log-probs, bf16"]["values"]["mean_abs_diff"] > 0
  assert rows("sharded_step")["sampler: tokens and log-probs"]["values"]["tokens_equal"] == 1.0
  timed = [r for r in parts["speed_0.5b"]["rows"] if "rows x" in r["check"]]
  assert timed and timed[0]["values"]["plan_config"] is True
  for key in ("tokens_per_s", "sample_mfu", "update_s", "update_mfu"):
    assert timed[0]["values"][key] > 0, key
  assert rows("speed_1.5b")["Qwen2.5-1.5B shape"]["values"]["layers"] == 28
  (plan,) = parts["plan_memory"]["rows"]
  assert plan["values"]["plan_learner_gib"] > 0 and plan["values"]["plan_sampler_gib"] > 0
  (smoke,) = parts["smoke_train"]["rows"]
  assert smoke["values"]["steps"] == 3
  (trl,) = parts["trl_grpo"]["rows"]
  have_trl = all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))
  if have_trl:
    assert trl["status"] == "ok" and trl["values"]["rljax_tokens_per_step"] == trl["values"]["trl_tokens_per_step"]
  else:
    assert trl["status"] == "skipped" and "not installed" in trl["note"]


def test_a_crashing_or_hanging_part_keeps_its_rows_and_the_run_goes_on(tmp_path):
  out = str(tmp_path)
  proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--cpu", "--out", out,
                         "--parts", "selftest_crash,selftest_hang"], env=_env(), capture_output=True, text=True,
                        timeout=300, cwd=ROOT)
  assert proc.returncode == 1
  results, md = _load(out)
  crash, hang = results["parts"]
  assert crash["status"] == "error" and [r["check"] for r in crash["rows"]] == ["before the crash", "(crash)"]
  assert hang["status"] == "timeout" and [r["check"] for r in hang["rows"]] == ["before the hang", "(timeout)"]
  assert results["finished"] and "| selftest_hang | timeout |" in md
  # No env part ran: the header still names the device and jax (from the orchestrator, without jax)
  import importlib.metadata
  header = md.splitlines()[0]
  assert "(cpu)" in header and f"jax {importlib.metadata.version('jax')};" in header, header
  with open(os.path.join(out, "log.txt"), encoding="utf-8") as f:
    assert "this part crashes on purpose" in f.read()


def test_gpu_plan_target_is_parsed_and_refused_without_a_gpu():
  with pytest.raises(ConfigError, match=r"--topology='gpu:0'"):
    parse_topology("gpu:0")
  with pytest.raises(ConfigError, match="JAX_PLATFORMS=cuda"):   # this test process runs jax on the CPU
    parse_topology("gpu:1")


def test_trl_part_rljax_config_validates_without_trl(tmp_path):
  # The TRL comparison skips where trl is absent (here and in CI), so its rljax side's config is
  # validated on its own: an earlier version named a source verifier no reward component used, and
  # the GPU run was the first to find out.
  sys.path.insert(0, SCRIPTS)
  try:
    import parts_trl
  finally:
    sys.path.remove(SCRIPTS)
  from rljax.config.validation import validate
  job = dict(prompts=2, group=4, words=8, new_tokens=8, steps=2, cpu=True, out=str(tmp_path),
             model_dir=str(tmp_path / "model"), data=str(tmp_path / "prompts.jsonl"))
  cfg = parts_trl.rljax_config(job)
  validate(cfg)
  assert cfg.data.sources[0]["verifier"] == "none" and cfg.rewards.components[0]["name"] == "vowels"
