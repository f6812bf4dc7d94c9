"""The sampler's decode layouts (rljax/sharding.py DecodeLayout) and the draw over vocabulary shards.

On the conftest's 8 simulated CPU devices: a model whose replicated copy exceeds the budget decodes
tensor-parallel on the same devices (fsdp folded into tensor), its compiled decode loop all-gathers
nothing (per layer only [rows, D] activations are all-reduced; the draw combines per-row figures),
and it draws the tokens the replicated layout draws for the same key.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sharding as shd
from rljax.models.config import ModelConfig
from rljax.models.policy import init_params
from rljax.plan import hlo
from rljax.rl import LossConfig
from rljax.rollout import draw
from rljax.rollout.draw import SamplingParams
from rljax.rollout.sampler import decode_layout_for, make_generate_fn
from rljax.trainer.step import StepSpec

# 1040 = 4 x 260 columns: with 4 vocabulary shards, draw blocks of 256 straddle shard edges.
VOCAB = 1040


@pytest.mark.parametrize("sp", [SamplingParams(1, 4), SamplingParams(1, 4, temperature=0.7, top_k=50, top_p=0.9),
                                SamplingParams(1, 4, top_p=0.3, min_p=0.05), SamplingParams(1, 4, greedy=True)],
                         ids=["plain", "topk_topp", "topp_minp", "greedy"])
def test_draw_over_vocabulary_shards_picks_the_unsplit_token(sp):
  mesh = shd.make_mesh((2, 1, 4))
  logits = jax.random.normal(jax.random.key(1), (8, VOCAB)) * 3
  vocab = draw.vocab_shards(mesh, shd.DEFAULT_RULES, logits.shape)
  assert vocab is not None and vocab.axis == "tensor"
  unsplit_fn = jax.jit(lambda x, k: draw.sample_logits(x, sp, k))
  split_fn = jax.jit(lambda x, k: draw.sample_logits(x, sp, k, vocab=vocab))
  for key in (jax.random.key(0), jax.random.key(7)):
    whole, split = unsplit_fn(logits, key), split_fn(logits, key)
    np.testing.assert_array_equal(whole[0], split[0])
    # log-probs and entropy: the same sums in another order (f32).
    np.testing.assert_allclose(whole[1], split[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(whole[2], split[2], rtol=1e-5, atol=1e-6)
  if sp.top_p == 1.0 and not sp.is_greedy:   # per-row keys (the continuous-batching draw)
    keys, rows = jax.random.split(jax.random.key(5), 8), jnp.arange(8, dtype=jnp.int32) + 3
    whole = jax.jit(lambda x, k, r: draw.sample_logits(x, sp, k, rows=r))(logits, keys, rows)
    split = jax.jit(lambda x, k, r: draw.sample_logits(x, sp, k, rows=r, vocab=vocab))(logits, keys, rows)
    np.testing.assert_array_equal(whole[0], split[0])


def _loop_collectives(compiled) -> list[tuple[str, str]]:
  """(opcode, type) of every collective in the bodies of the compiled decode loops (and what they call)."""
  mod = hlo.Module(compiled.as_text())
  out, seen = [], set()

  def walk(name):
    if name in seen or name not in mod.comps:
      return
    seen.add(name)
    for inst in mod.comps[name].instructions:
      if hlo.collective_kind(inst.opcode):
        out.append((inst.opcode, inst.type))
      for _, callee in inst.callees:
        walk(callee)

  for lp in mod.dynamic_loops():
    walk(lp.body)
    walk(lp.condition)
  return out


def test_tensor_parallel_decode_moves_no_weights_and_draws_the_replicated_tokens():
  cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=4, head_dim=8, dtype="float32")
  params = init_params(cfg, jax.random.key(0))
  mesh = shd.make_mesh((1, 8, 1))
  spec = StepSpec(model=cfg, sampling=SamplingParams(num_samples=2, max_new_tokens=8),
                  loss=LossConfig.from_preset("grpo", kl_coef=0.0), prompts=4)
  total = sum(x.size * 4 for x in jax.tree.leaves(params))
  # A budget of a third of the model: half the weights per chip (fold 2) is too much, a quarter fits.
  layout = decode_layout_for(cfg, params, mesh, total // 3)
  assert (layout.fold, layout.fallback, layout.kind(mesh)) == (4, False, "tensor-parallel")
  assert dict(layout.mesh(mesh).shape) == {"data": 1, "fsdp": 2, "tensor": 4}
  assert total / 4 <= layout.bytes_per_chip <= total // 3
  assert decode_layout_for(cfg, params, mesh, None).kind(mesh) == "replicated"
  assert decode_layout_for(cfg, params, mesh, 1).kind(mesh) == "fallback"

  ids = jax.random.randint(jax.random.key(1), (4, 8), 1, VOCAB)
  mask = jnp.ones((4, 8), bool)
  out = {}
  for name, lay in (("replicated", shd.DecodeLayout()), ("tensor", layout)):
    compiled = jax.jit(make_generate_fn(spec, mesh, decode_layout=lay)).lower(params, jax.random.key(2), ids,
                                                                            mask).compile()
    found = _loop_collectives(compiled)
    if name == "tensor":
      # No all-gather at all inside the loop: the weights stay where they are and the logits are
      # drawn where they lie. Every collective is a per-row figure of the 4 rows a chip decodes: at
      # most a draw block (256 f32) or a [D] activation per row; all of them together are less
      # than one chip's shard of the output projection ([D, V / 4] f32 = 33 KB).
      assert found and not [f for f in found if "all-gather" in f[0]], found
      assert max(hlo.type_bytes(t) for _, t in found) <= 4 * 256 * 4, found
      assert sum(hlo.type_bytes(t) for _, t in found) < 32 * VOCAB // 4 * 4, found
    out[name] = compiled(params, jax.random.key(2), ids, mask)
  np.testing.assert_array_equal(out["replicated"].tokens, out["tensor"].tokens)
  np.testing.assert_allclose(out["replicated"].logprobs, out["tensor"].logprobs, atol=1e-5)
  # Continuous batching (4 slots for 8 rows: 2 per row block of the decode mesh) draws per row from
  # the vocabulary shards too, and the samples do not depend on it.
  slotted = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, slots=4))
  got = jax.jit(make_generate_fn(slotted, mesh, decode_layout=layout))(params, jax.random.key(2), ids, mask)
  np.testing.assert_array_equal(out["replicated"].tokens, got.tokens)


def _plan(argv):
  import contextlib
  import io
  import json

  from rljax.plan import main
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = main(argv + ["--json"])
  return status, json.loads(out.getvalue())


def test_plan_decides_the_decode_layout_at_full_depth_and_warns_on_gathered_weights(monkeypatch):
  """`rljax plan` reports the layout, decided from the full-depth weights even when it compiles
  shallow models, and the bytes the compiled decode loop all-gathers per token."""
  import os

  from rljax.config import resolve_config
  from rljax.plan import programs as progs, report as rep
  from rljax.plan.topology import GIB
  tiny = ["--config", os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py"),
          "--config.model.random.vocab_size=1040", "--config.model.random.num_layers=4",
          "--config.model.random.num_heads=4", "--config.model.random.num_kv_heads=4",
          "--config.train.prompts_per_step=8", "--config.sampling.num_samples=2", "--config.data.max_prompt_tokens=8",
          "--config.sampling.max_new_tokens=4", "--config.mesh.shape=(1,-1,1)", "--topology", "cpu:8",
          "--program", "sampler"]
  run = progs.build_run(resolve_config(tiny[:-4])[0])
  mesh = shd.make_mesh((1, 8, 1))
  whole = progs.decode_layout(run, mesh, progs.build_inputs(run, mesh)).bytes_per_chip   # replicated, 4 layers
  # A budget (half the chip) of 3/4 of the 4-layer model: the 1- and 2-layer compiles would fit
  # replicated; the real depth needs the weights split over a tensor axis of 2.
  status, plan = _plan(tiny + ["--layers", "1,2", f"--hbm-gib={1.5 * whole / GIB}"])
  dec = plan["decode"]
  assert (dec["kind"], dec["fold"], dec["mesh"], dec["rows_per_chip"]) == ("tensor-parallel", 2, [1, 4, 2], 4), dec
  assert dec["budget_bytes"] == int(1.5 * whole / GIB * GIB) // 2 and dec["weights_bytes_per_chip"] < whole * 0.75
  assert "full depth (4 layers)" in dec["decided_at"] and plan["programs"]["sampler"]["extrapolated"]
  assert dec["all_gather_bytes_per_token"] == 0 and dec["warning"] is None
  # Nothing fits a budget of 1 KiB: the fallback splits the weights over fsdp and gathers them per
  # token. On this CPU target the gathered bytes are small, so the threshold is lowered to see the warning.
  monkeypatch.setattr(rep, "DECODE_GATHER_WARN_BYTES", 0)
  status, plan = _plan(tiny + [f"--hbm-gib={2048 / GIB}"])
  dec = plan["decode"]
  assert dec["kind"] == "fallback" and dec["all_gather_bytes_per_token"] > 0, dec
  assert "larger slice" in dec["warning"] and status == 3


@pytest.mark.parametrize("generator_mesh", [(-1, 1, 1), (2, 1, 2)], ids=["data", "tensor"])
def test_async_generators_hold_the_compute_dtype_decode_copy(tmp_path, generator_mesh):
  """rollout.mode='async': the parameters published to the 4 generator devices are the sampler's
  copy (bf16 matrices, the decode layout on the generator mesh `rollout.generator_mesh`), not a
  float32 replicated copy; with a tensor axis of 2 each chip holds about half of that copy."""
  import math
  import os

  from rljax.config_overrides import apply_overrides, load_config_file
  from rljax.trainer.loop import Trainer
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py"))
  apply_overrides(cfg, [f"output.dir={str(tmp_path / 'run')!r}", "checkpoint.resume=False", "train.steps=1",
                        "rollout.mode='async'", "model.dtype='bfloat16'", f"rollout.generator_mesh={generator_mesh}"])
  trainer = Trainer(cfg)
  try:
    published, _ = trainer.runner.published
    learner = trainer.state.params
    mesh = trainer.generator_mesh
    assert dict(mesh.shape) == {"data": 4 // generator_mesh[2], "fsdp": 1, "tensor": generator_mesh[2]}
    gen_devices = set(mesh.devices.flat)
    before = after = replicated = 0
    for p, q in zip(jax.tree.leaves(published), jax.tree.leaves(learner)):
      assert set(p.sharding.device_set) == gen_devices
      assert p.dtype == (jnp.bfloat16 if p.ndim >= 2 else q.dtype) and q.dtype == jnp.float32
      before += math.prod(q.shape) * 4                      # the old copy: float32, replicated
      replicated += math.prod(p.shape) * p.dtype.itemsize
      after += math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize
    layout = trainer.runner.gen_layout
    assert after == layout.bytes_per_chip and before / 2 <= replicated < 0.55 * before
    if generator_mesh[2] == 1:
      assert layout.kind(mesh) == "replicated" and after == replicated   # CPU devices report no memory: no budget
    else:
      assert layout.kind(mesh) == "tensor-parallel" and 0.45 * replicated < after < 0.6 * replicated
  finally:
    trainer.close()


def test_generator_mesh_that_does_not_fit_the_generator_devices_names_the_field(tmp_path):
  from rljax.config_overrides import apply_overrides
  from rljax.configs import smoke
  from rljax.errors import ConfigError
  from rljax.trainer.loop import Trainer
  cfg = smoke.get_config()
  apply_overrides(cfg, [f"output.dir={str(tmp_path / 'run')!r}", "rollout.mode='async'",
                        "rollout.generator_mesh=(1, 1, 3)"])
  with pytest.raises(ConfigError, match=r"config.rollout.generator_mesh=\(1, 1, 3\) uses 3 devices but 4"):
    Trainer(cfg)
