"""What each kind of reward costs a training step: a verifier, a reward model and a judge on the
mesh, and a remote judge over HTTP (docs/rewards.md, "Choosing a reward").

    python scripts/bench_reward_kinds.py [--steps 6] [--latency-ms 20] [--json out.json]

The smoke recipe's policy (a tiny random Qwen-shaped model, 8 prompts x G=8, 8 new tokens) trains
in the fused mode with, in turn: the vowel verifier alone; plus a reward model of the policy's own
size; plus a judge of that size; plus a remote judge behind a local OpenAI-compatible server that
answers after `--latency-ms`. Each trainer compiles and warms up on 2 steps; then they take
`--steps` steps in turn (round robin, so that the machine's load touches every kind alike) and the
median step and phase times are reported, with the models' parameter bytes (fused mode: the
"sample" phase includes the reward models' and judges' forward, "score" is the reward callback).
Step times of models this small are mostly fixed costs (dispatch, the callback); docs/rewards.md
scales the figures by FLOPs.
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


class _Judge(http.server.ThreadingHTTPServer):
  daemon_threads = True
  latency = 0.02


class _Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    time.sleep(self.server.latency)
    text = body["messages"][-1]["content"]
    data = json.dumps({"choices": [{"index": 0, "message": {"content": "yes" if "a" in text else "no"}}]}).encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)


def _components(kind: str, models: str, url: str) -> list[dict]:
  comps = [dict(name="vowels", verifier="rljax.configs.smoke:vowel_fraction", weight=1.0)]
  if kind == "reward_model":
    comps.append(dict(name="rm", model=os.path.join(models, "rm"), weight=0.5))
  if kind == "judge":
    comps.append(dict(name="judge", judge=os.path.join(models, "judge"), weight=0.5,
                      template="Q: {prompt}\nA:\n{completion}\nIs it good? Reply yes or no.",
                      kwargs=dict(yes=["yes"], no=["no"])))
  if kind == "remote_judge":
    comps.append(dict(name="judge", verifier="remote_judge", weight=0.5, kwargs=dict(
        base_url=url, model="judge", api_key_env=None, template="Q: {prompt}\nA: {completion}\nGood?",
        max_concurrency=16, timeout_s=10.0, total_timeout_s=30.0)))
  return comps


def build(kind: str, models: str, url: str, steps: int, out_dir: str):
  """A Trainer of the smoke recipe with `kind`'s components, warmed up (compiled) on 2 steps."""
  from rljax.config import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  cfg = load_config_file(os.path.join(ROOT, "rljax", "configs", "smoke.py"))
  apply_overrides(cfg, [f"output.dir={os.path.join(out_dir, kind)!r}", f"train.steps={steps + 2}",
                        "output.progress=False", "checkpoint.every=0"])
  cfg.rewards.components = _components(kind, models, url)
  trainer = Trainer(cfg)
  for _ in range(2):
    trainer.run_step()
  return trainer


def measure(trainers: dict, steps: int) -> list[dict]:
  """Median step and phase times of each trainer, their steps taken in turn (round robin), so that
  a change of the machine's load touches every kind alike."""
  import jax
  times = {k: [] for k in trainers}
  for _ in range(steps):
    for kind, trainer in trainers.items():
      t = time.perf_counter()
      m = trainer.run_step()
      times[kind].append({"step_s": time.perf_counter() - t, **{k: m[k] for k in ("time/sample", "time/score",
                                                                                  "time/update") if k in m}})
  out = []
  for kind, trainer in trainers.items():
    graph = trainer.scorer.reward_fn.graph
    model_bytes = 0 if graph is None else sum(x.nbytes for x in jax.tree.leaves(graph.params))
    row = {"kind": kind, "model_param_bytes": model_bytes,
           "policy_param_bytes": sum(x.nbytes for x in jax.tree.leaves(trainer.state.params))}
    for key in times[kind][0]:
      row[key] = statistics.median(t[key] for t in times[kind])
    out.append(row)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=6, help="timed steps per kind (after 2 warm-up steps)")
  p.add_argument("--latency-ms", type=float, default=20.0, help="the remote judge server's latency per request")
  p.add_argument("--json", default=None, help="write the results here too")
  args = p.parse_args(argv)
  from test_reward_models import save_tiny

  from rljax.tokenizer import load_tokenizer
  tok = load_tokenizer("smollm2-135m-instruct")
  server = _Judge(("127.0.0.1", 0), _Handler)
  server.latency = args.latency_ms / 1000
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}/v1"
  kinds = ("verifier", "reward_model", "judge", "remote_judge")
  with tempfile.TemporaryDirectory() as tmp:
    save_tiny(os.path.join(tmp, "rm"), "qwen2", "model", tok, seed=1)
    save_tiny(os.path.join(tmp, "judge"), "qwen2", "judge", tok, seed=2)
    trainers = {kind: build(kind, tmp, url, args.steps, tmp) for kind in kinds}
    try:
      results = measure(trainers, args.steps)
    finally:
      for trainer in trainers.values():
        trainer.close()
  server.shutdown()
  base = results[0]["step_s"]
  for r in results:
    r["vs_verifier"] = r["step_s"] / base
    print(f"{r['kind']:>13}: {r['step_s'] * 1000:7.1f} ms/step ({r['vs_verifier']:.2f}x the verifier alone; "
          f"sample+models {r.get('time/sample', 0) * 1000:.0f} ms, score {r.get('time/score', 0) * 1000:.0f} ms, "
          f"update {r.get('time/update', 0) * 1000:.0f} ms), model parameters {r['model_param_bytes'] / 2**20:.1f} "
          f"MiB (policy {r['policy_param_bytes'] / 2**20:.1f} MiB)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
