"""Multi-turn rollouts: decoding resumed from the KV cache vs re-prefilling the history each turn.

    python scripts/bench_multiturn.py                 # SmolLM2-135M-Instruct, 8 trajectories, ~3 min
    python scripts/bench_multiturn.py --turns 6 --new-tokens 384

Both runs make the same trajectories (same key, same scripted tool calls; the script forces each
row to open every model turn with a calculator call until it has made `--turns` of them, then the
model writes freely until EOS or the token budget). "cache" feeds each round only the pending
token and the tool response into the existing cache (rljax/rollout/tools.py); "reprefill" rebuilds
every row's cache from its whole history each round, the way a generate() call per turn would
(tests/tools_testlib.py: PrefillingToolRollout; ScriptedDraw forces the scripted calls).
Each mode runs twice and the second run is timed (the first compiles). The script checks that
both produced identical tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))   # tools_testlib

from benchlib import Result, add_json_arg, machine, report  # noqa: E402

QUESTIONS = ["What is 17 * 23?", "Compute 1234 + 5678.", "What is 2 ** 12?", "Divide 1000 by 8.",
             "What is 99 * 99?", "Compute 3 * (4 + 5).", "What is 81 / 9?", "What is 7 squared?"]


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--turns", type=int, default=4, help="scripted tool calls per trajectory")
  ap.add_argument("--new-tokens", type=int, default=320, help="trajectory width (model and tool tokens)")
  ap.add_argument("--segment", type=int, default=32, help="decode steps per segment")
  add_json_arg(ap)
  args = ap.parse_args()

  import jax
  import numpy as np
  from tools_testlib import scripted_tool_rollout

  from rljax.models.io import load_pretrained
  from rljax.rollout import SamplingParams
  from rljax.tools import ToolRunner

  policy = load_pretrained(args.model)
  tok = policy.tokenizer
  prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False)) for q in QUESTIONS]
  width = -(-max(map(len, prompts)) // 16) * 16
  ids = np.zeros((len(prompts), width), np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for r, p in enumerate(prompts):
    ids[r, width - len(p):], mask[r, width - len(p):] = p, True
  calls = [tok.encode(f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{r + 2} * {t + 3}"}}}}'
                      '</tool_call>') for r in range(len(prompts)) for t in range(args.turns)]
  script = {(row, turn): calls[row * args.turns + turn] for row in range(len(prompts)) for turn in range(args.turns)}
  sp = SamplingParams(num_samples=1, max_new_tokens=args.new_tokens, temperature=1.0,
                      stop_token_ids=tuple(tok.stop_ids))
  out, seconds, metrics = {}, {}, {}
  with ToolRunner(["calculator"], num_workers=2) as runner:
    for resume in ("cache", "reprefill"):
      engine = scripted_tool_rollout(policy.config, tok, runner, sp, script, fmt="hermes",
                                     prefill=resume == "reprefill",
                                     max_turns=args.turns, segment_tokens=args.segment)
      engine.run(policy.params, ids, mask, jax.random.key(0))      # compiles
      start = time.perf_counter()
      _, info = engine.run(policy.params, ids, mask, jax.random.key(0))
      seconds[resume] = time.perf_counter() - start
      out[resume], metrics[resume] = info.trajectories, info.metrics
  a, b = out["cache"], out["reprefill"]
  same = bool(np.array_equal(a.tokens, b.tokens) and np.array_equal(a.lengths, b.lengths))
  tokens = int(a.lengths.sum())
  print(f"{len(prompts)} trajectories, {a.turns.mean():.1f} tool calls each, {tokens} trajectory tokens "
        f"({metrics['cache']['tools/tool_token_fraction']:.0%} tool tokens), {int(metrics['cache']['tools/feeds'])} "
        "feed rounds; "
        f"identical tokens: {same}")
  print(machine())
  report([Result("multi-turn rollout, cache resume vs re-prefill (tokens/s)",
                 f"{tokens / seconds['cache']:.1f} tok/s ({seconds['cache']:.2f} s)",
                 f"{tokens / seconds['reprefill']:.1f} tok/s ({seconds['reprefill']:.2f} s, re-prefill)",
                 f"{seconds['reprefill'] / seconds['cache']:.2f}x faster")], args.json)
  if not same:
    raise SystemExit("the two modes produced different trajectories")


if __name__ == "__main__":
  main()
