"""Continuous batching in the sampler (`sampling.slots`, rljax/rollout/slots.py): the same samples
through fewer decode slots, refilled inside the compiled loop, on one device and on a mesh."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import hf_model, left_padded_prompts

from rljax import config as config_lib
from rljax.config import apply_overrides, load_config_file
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.models.convert import hf_to_params
from rljax.rollout import SamplingParams, sample
from rljax.rollout.draw import row_gumbel

_sample = jax.jit(sample, static_argnames=("config", "sp", "eos_ids", "mesh"))
STOPS = tuple(range(3, 12))   # 9 of 256 ids: geometric lengths (mean ~28) with rows at the budget


def _convert(model):
  config = ModelConfig.from_hf(model.config.to_dict())
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  return config, hf_to_params(config, sd.__getitem__, set(sd))


def _gemma3():
  """A Gemma 3 with sliding-window layers: their window reaches into the shared prompt cache."""
  from test_decode_pinned import _gemma3 as build
  return build()


def test_row_gumbel_is_the_rows_share_of_a_batch_draw():
  """Row b of `row_gumbel(keys, rows, n)` is, bit for bit, row rows[b] of the batch noise
  jax.random.gumbel(keys[b], (R, n)): the per-row draw reproduces the fixed-shape sampler's."""
  keys = jax.random.split(jax.random.key(7), 3)
  for n, rows in ((192, [5, 0, 63]), (256, [1, 1, 40]), (300, [0, 9, 2])):
    got = np.asarray(jax.jit(row_gumbel, static_argnums=2)(keys, jnp.asarray(rows, jnp.int32), n))
    for b, r in enumerate(rows):
      want = np.asarray(jax.random.gumbel(keys[b], (64, n), jnp.float32))[r]
      np.testing.assert_array_equal(got[b], want)


def test_slots_give_the_same_samples_with_less_cache():
  """Gemma 3 (sliding windows reaching into the shared prompt cache; the mesh test below runs a
  Qwen3). Same key: slots = rows (the fixed-shape loop) and slots = rows / 4 give the same tokens,
  masks, lengths and truncation flags; log-probs and entropies agree to 1e-5 (the prompt
  attention is a per-row gather instead of a per-group matmul: another summation order). Fewer
  slots run more decode steps and keep a smaller completion cache: the compiled program's
  temporary memory drops by at least half the analytic cache difference."""
  config, params = _convert(_gemma3())
  ids, mask = left_padded_prompts((9, 4, 6), config.vocab_size, low=3, seed=5)
  outs, temp = {}, {}
  for slots in (0, 3):
    sp = SamplingParams(num_samples=4, max_new_tokens=40, temperature=0.8, top_p=0.9, slots=slots)
    compiled = _sample.lower(config, params, ids, mask, sp, jax.random.key(42), eos_ids=STOPS).compile()
    outs[slots] = jax.device_get(compiled(params, ids, mask, jax.random.key(42)))
    temp[slots] = compiled.memory_analysis().temp_size_in_bytes
  a, b = outs[0], outs[3]
  lengths = a.lengths
  assert lengths.min() < 20 and (lengths == 40).any() and len(set(lengths.tolist())) > 4   # ragged
  for field in ("tokens", "mask", "lengths", "truncated"):
    np.testing.assert_array_equal(getattr(b, field), getattr(a, field), err_msg=field)
  np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
  np.testing.assert_allclose(b.entropy, a.entropy, atol=1e-5)
  assert a.decode_step.max() == lengths.max() - 1
  assert b.decode_step.max() > a.decode_step.max()
  # Each row's last token came from a step no earlier than its own length allows.
  assert (b.decode_step >= np.maximum(lengths - 1, 0)).all()
  cache_rows = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 40 * 4   # bytes per row
  assert temp[0] - temp[3] > 0.5 * cache_rows * (12 - 3), (temp, cache_rows)


def test_slots_on_a_mesh_refill_without_cross_device_traffic():
  """8 devices (data 2 x fsdp 2 x tensor 2): 16 rows and 8 slots in 4 blocks. The samples equal the
  fixed-shape loop's, and the decode loops hold no more collectives than the fixed-shape loops
  (each block refills from its own rows: nothing is gathered across devices per refill; the one
  extra is the scalar all-reduce of the loop's end test)."""
  from rljax import sharding as shd
  from rljax.models.policy import param_shardings
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  config, params = _convert(hf_model("qwen3"))
  ids, mask = left_padded_prompts((9, 4, 6, 7), config.vocab_size, low=3, seed=5)
  mesh = shd.make_mesh((2, 2, 2))
  params = jax.device_put(params, param_shardings(config, mesh))
  ids, mask = (jax.device_put(x, shd.batch_sharding(mesh, 2, 4)) for x in (ids, mask))
  outs, loops = {}, {}
  for slots in (0, 8):
    sp = SamplingParams(num_samples=4, max_new_tokens=40, temperature=0.8, slots=slots)
    compiled = _sample.lower(config, params, ids, mask, sp, jax.random.key(3), eos_ids=STOPS, mesh=mesh).compile()
    out = compiled(params, ids, mask, jax.random.key(3))
    assert out.tokens.sharding.spec[0] == ("data", "fsdp")
    outs[slots], loops[slots] = jax.device_get(out), _loop_collectives(compiled.as_text())
  np.testing.assert_array_equal(outs[8].tokens, outs[0].tokens)
  np.testing.assert_allclose(outs[8].logprobs, outs[0].logprobs, atol=1e-5)
  assert outs[8].decode_step.max() > outs[0].decode_step.max()
  (fixed, n_fixed), (slotted, n_slotted) = loops[0], loops[8]
  assert n_fixed == n_slotted >= 2   # the cache stages: one loop each
  arrays = lambda ops: [op for op in ops if not op[1].split("{")[0].endswith("[]")]
  assert len(arrays(slotted)) <= len(arrays(fixed)), (slotted, fixed)
  assert len(slotted) <= len(fixed) + n_slotted, (slotted, fixed)


def _loop_collectives(hlo: str) -> tuple[list[tuple[str, str]], int]:
  """(op, result shape) of every collective inside a while loop's condition or body, and the loops."""
  names, loops = set(), 0
  for cond, body in re.findall(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)", hlo):
    names.update((cond, body))
    loops += 1
  ops = []
  for block in re.split(r"\n(?=\S)", hlo):
    head = re.match(r"%?([\w.\-]+) ", block)
    if head and head.group(1) in names:
      ops += [(op, shape) for shape, op in re.findall(
          r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", block)]
  return ops, loops


def test_slots_that_do_not_split_over_the_batch_shards_are_refused():
  from rljax import sharding as shd
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  config, params = _convert(hf_model("qwen3"))
  ids, mask = left_padded_prompts((9, 4, 6, 7), config.vocab_size, low=3, seed=5)
  sp = SamplingParams(num_samples=4, max_new_tokens=8, slots=6)   # 16 rows in 4 shards: 6 slots do not split
  with pytest.raises(ConfigError, match=r"sampling\.slots=6.*divisible by 4"):
    jax.eval_shape(lambda p: sample(config, p, ids, mask, sp, jax.random.key(0), mesh=shd.make_mesh((2, 2, 2))),
                   params)


def _cfg(*overrides):
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "default.py"))
  apply_overrides(cfg, overrides)
  return cfg


@pytest.mark.parametrize("overrides,match", [
    (["sampling.slots=-1"], r"sampling\.slots=-1 must be an integer >= 0"),
    (["sampling.slots=33"], r"sampling\.slots=33 is more than the rows sampled per step \(8 prompts x 4"),
    (["sampling.slots=16", "tools.enabled=True", "rollout.mode='pipelined'"], r"sampling\.slots with tools\.enabled"),
    (["sampling.slots=16", "rollout.mode='partial'"], r"sampling\.slots with rollout\.mode='partial'"),
])
def test_bad_slots_config_names_the_field(overrides, match):
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(_cfg(*overrides))
  config_lib.validate(_cfg("sampling.slots=16"))
  config_lib.validate(_cfg("sampling.slots=32"))
