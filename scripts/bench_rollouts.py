"""End-to-end throughput of the rollout modes (fused, pipelined, async) on the same work.

    python scripts/bench_rollouts.py                        # 8 simulated CPU devices, ~6 min
    python scripts/bench_rollouts.py --steps 8 --new-tokens 32 --delay 0.5

A small random Llama (the smoke recipe's vowel task, SmolLM2's tokenizer) trains for `--steps`
steps of 8 prompts x G=8 in each mode. The verifier waits `delay` seconds per item before
scoring (scripts/slow_verifier.py): a latency-bound verifier such as a remote
judge or a test run, calibrated so that scoring a batch takes about as long as generating it
(measured by a fused calibration run in the same process). The first step of each mode
(compilation) is excluded; completions/s and reward/s (reward summed over completions, per
wall-clock second) are over the remaining steps.

What CPU simulation can show: overlap of host-side scoring latency with device work. What it
cannot: 8 simulated devices share this machine's cores, so the async mode's split mesh
(generators on 4 devices, learner on 4) does not add compute the way separate accelerators
would; generation and updates contend for the same cores.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The reward workers import the slow verifier from scripts/ by path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                         os.environ.get("PYTHONPATH", "")]))

from benchlib import Result, add_json_arg, machine, report  # noqa: E402


def make_config(mode: str, out_dir: str, args, delay_s: float, steps: int, staleness: int = -1,
                proximal: str = "recompute"):
  from rljax.config_overrides import apply_overrides, load_config_file
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py"))
  apply_overrides(cfg, [
      f"output.dir={out_dir!r}", "checkpoint.resume=False", f"train.steps={steps}",
      f"rollout.mode={mode!r}", f"rollout.max_staleness={staleness}", f"rollout.proximal={proximal!r}",
      f"sampling.max_new_tokens={args.new_tokens}", "sampling.ignore_eos=True",
      f"model.random.hidden_size={args.hidden}", f"model.random.intermediate_size={4 * args.hidden}",
      f"model.random.num_layers={args.layers}", "model.random.head_dim=32", "model.random.num_heads=4",
      "optim.learning_rate=0.01", f"rewards.num_workers={args.workers}", "output.tensorboard=False"])
  cfg.rewards.components = [dict(name="vowels", verifier="slow_verifier:slow_vowel_fraction", weight=1.0,
                                 kwargs=dict(delay_s=delay_s))]
  return cfg


def run_mode(mode: str, args, delay_s: float, steps: int, staleness: int = -1, proximal: str = "recompute") -> dict:
  from rljax.trainer.loop import Trainer
  with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(make_config(mode, out, args, delay_s, steps, staleness, proximal))
    try:
      metrics = [trainer.run_step()]          # compiles
      start = time.perf_counter()
      metrics += [trainer.run_step() for _ in range(steps - 1)]
      wall = time.perf_counter() - start
    finally:
      trainer.close()
  timed = metrics[1:]
  per_step = trainer.batch_rows * trainer.spec.group      # completions per step
  name = mode + (f" (max_staleness={staleness})" if staleness >= 0 else "") + (
      f" (proximal={proximal})" if proximal != "recompute" else "")
  return {"mode": name, "wall": wall, "completions_per_s": per_step * len(timed) / wall,
          "reward_per_s": sum(m["reward/mean"] * per_step for m in timed) / wall,
          "reward_last": statistics.mean(m["reward/mean"] for m in metrics[-2:]),
          "sample": statistics.median(m["time/sample"] for m in timed),
          "score": statistics.median(m["time/score"] for m in timed),
          "update": statistics.median(m["time/update"] for m in timed),
          "staleness": statistics.mean(m.get("rollout/staleness", 0.0) for m in timed),
          # async: each weight publish to the generator devices (bytes written over them, seconds)
          "publishes": [(m["rollout/publish_bytes"], m["rollout/publish_s"]) for m in timed
                        if m.get("rollout/publish_bytes")]}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=8, help="steps per mode (the first is excluded from timing)")
  p.add_argument("--new-tokens", type=int, default=16)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--workers", type=int, default=4, help="reward pool workers")
  p.add_argument("--delay", type=float, default=0.0,
                 help="verifier latency per item in s (default: calibrated so scoring a batch ~ generating it)")
  add_json_arg(p)
  args = p.parse_args()
  logging.basicConfig(level=logging.WARNING)
  print(machine())
  delay = args.delay
  if not delay:
    cal = run_mode("fused", args, 0.0, 2)
    # 64 items on `workers` workers: a batch costs 64 * delay / workers seconds of scoring.
    delay = cal["sample"] * args.workers / 64
    print(f"calibration: generation {cal['sample']:.2f} s/batch -> verifier delay {delay * 1000:.1f} ms/item")
  # pipelined at staleness 0 runs the same two programs without overlap: it separates the gain of
  # overlapping from the difference between one fused program and two halves.
  # proximal=sampler: lp_old is the sampler's (PPO clipped against the behaviour policy), so the
  # off-policy update skips the forward that recomputes it.
  runs = (("fused", -1, "recompute"), ("pipelined", 0, "recompute"), ("pipelined", -1, "recompute"),
          ("pipelined", -1, "sampler"), ("async", -1, "recompute"), ("async", -1, "sampler"))
  rows = [run_mode(mode, args, delay, args.steps, staleness, proximal) for mode, staleness, proximal in runs]
  print(f"\n{'mode':<50} {'wall s':>7} {'compl/s':>8} {'reward/s':>9} {'reward':>7} "
        f"{'sample':>7} {'score':>7} {'update':>7} {'stale':>6}")
  for r in rows:
    print(f"{r['mode']:<50} {r['wall']:7.1f} {r['completions_per_s']:8.2f} {r['reward_per_s']:9.2f} "
          f"{r['reward_last']:7.3f} {r['sample']:7.2f} {r['score']:7.2f} {r['update']:7.2f} {r['staleness']:6.2f}")
  for r in rows:
    if r["publishes"]:
      mib = statistics.median(b for b, _ in r["publishes"]) / 2**20
      ms = statistics.median(t for _, t in r["publishes"]) * 1000
      print(f"{r['mode']}: {len(r['publishes'])} weight publishes, {mib:.1f} MiB written to the generator "
            f"devices and {ms:.1f} ms each (median)")
  fused, sequential = rows[0], rows[1]
  ratio = lambda r, base, key: f"{r[key] / base[key]:.2f}x"
  results = [Result(f"rollout mode {r['mode']}: completions/s (verifier {delay * 1000:.0f} ms/item)",
                    f"{r['completions_per_s']:.2f}", f"fused {fused['completions_per_s']:.2f}",
                    ratio(r, fused, "completions_per_s")) for r in rows[1:]]
  results += [Result(f"rollout mode {r['mode']}: reward/s", f"{r['reward_per_s']:.2f}",
                     f"fused {fused['reward_per_s']:.2f}", ratio(r, fused, "reward_per_s")) for r in rows[1:]]
  results += [Result(f"rollout mode {r['mode']} vs the same two programs without overlap: completions/s",
                     f"{r['completions_per_s']:.2f}",
                     f"pipelined (max_staleness=0) {sequential['completions_per_s']:.2f}",
                     ratio(r, sequential, "completions_per_s")) for r in rows[2:]]
  report(results, args.json)


if __name__ == "__main__":
  main()
