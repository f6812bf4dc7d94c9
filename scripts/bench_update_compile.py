"""Compile time and temporaries of the update against the number of mini-batches.

The update scans over epochs x mini-batches (and each update over micro-batches), so its program
holds one copy of forward + backward whatever their numbers. Before the scan, the loop was
unrolled in Python inside jit: 7.4 / 41 / 124 s to compile for 1 / 4 / 16 mini-batches.

    python scripts/bench_update_compile.py [--mini-batches 1 4 16] [--layers 4]

Prints compile seconds, temporary bytes and HLO size per setting, and the ratio to 1 mini-batch.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def build(mini_batches: int, layers: int, prompts: int, group: int, width: int, new_tokens: int):
  import ml_collections

  from rljax.models.config import ModelConfig
  from rljax.models.policy import init_params
  from rljax.rl import LossConfig
  from rljax.rollout import Rollout, SamplingParams
  from rljax.trainer.optim import make_optimizer
  from rljax.trainer.state import TrainState
  from rljax.trainer.step import StepSpec, make_update_fn
  mc = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=layers, num_heads=4,
                   num_kv_heads=2, head_dim=64)
  sp = SamplingParams(num_samples=group, max_new_tokens=new_tokens, temperature=1.0)
  spec = StepSpec(model=mc, sampling=sp, loss=LossConfig.from_preset("grpo", kl_coef=0.0), prompts=prompts,
                  mini_batches=mini_batches)
  optim = ml_collections.ConfigDict(dict(learning_rate=1e-5, warmup_steps=0, min_lr_ratio=0.0, schedule="constant",
                                         max_grad_norm=1.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
  optimizer, schedule = make_optimizer(optim, 100)
  state = jax.eval_shape(lambda: TrainState.create(init_params(mc, jax.random.key(0)), optimizer, 0))
  n = prompts * group
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  rollout = Rollout(prompt_ids=s((n, width), jnp.int32), prompt_mask=s((n, width), bool),
                    tokens=s((n, new_tokens), jnp.int32), mask=s((n, new_tokens), bool),
                    context_mask=s((n, new_tokens), bool), logprobs=s((n, new_tokens), jnp.float32),
                    entropy=s((n, new_tokens), jnp.float32), lengths=s((n,), jnp.int32), truncated=s((n,), bool),
                    rewards=s((n,), jnp.float32), components=s((n, 1), jnp.float32), group_size=group)
  return jax.jit(make_update_fn(spec, optimizer, schedule)), state, rollout


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mini-batches", type=int, nargs="+", default=[1, 4, 16])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--new-tokens", type=int, default=128)
  args = ap.parse_args()
  rows = []
  for m in args.mini_batches:
    fn, state, rollout = build(m, args.layers, args.prompts, args.group, args.width, args.new_tokens)
    start = time.perf_counter()
    lowered = fn.lower(state, rollout)
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    rows.append((m, seconds, temp, len(compiled.as_text())))
  base = rows[0]
  print(f"{'mini-batches':>12} {'compile s':>10} {'ratio':>6} {'temp MiB':>9} {'ratio':>6} {'HLO chars':>10}")
  for m, sec, temp, size in rows:
    print(f"{m:>12} {sec:>10.2f} {sec / base[1]:>6.2f} {temp / 2**20:>9.1f} {temp / max(base[2], 1):>6.2f} {size:>10}")


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
