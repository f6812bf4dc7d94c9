"""Attention backends (rljax.models.attention) against the full-score `xla` reference, on CPU.

Values and gradients (w.r.t. q, k, v of a weighted sum of the output) in float32 agree within
atol = rtol = 1e-5 on: left and right padding, GQA (R = 3), packed rows with 2-3 segments, T not
a multiple of the block. Splash runs in Pallas interpret mode; cuDNN's wrapping (compaction of
padded rows, segment mask) runs with jax.nn.dot_product_attention's xla implementation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models import attention as attn
from rljax.models.config import ATTENTION_IMPLS, ModelConfig
from rljax.models.policy import apply_model, init_params
from rljax.models.transformer import positions_from_mask

TOL = dict(atol=1e-5, rtol=1e-5)


@functools.lru_cache(maxsize=None)
def _inputs(b=3, t=37, kh=2, r=3, dh=16, seed=0, packed=True):
  """q [B, T, K, R, Dh], k, v [B, T, K, Dh], a weight like q, token_mask and segment_ids [B, T].

  Row 0: three packed segments; row 1: left padding; row 2: two segments then right padding.
  """
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, kh, r, dh))
  k = jax.random.normal(ks[1], (b, t, kh, dh))
  v = jax.random.normal(ks[2], (b, t, kh, dh))
  w = jax.random.normal(ks[3], (b, t, kh, r, dh))
  mask = np.ones((b, t), bool)
  mask[1, :5] = False
  seg = np.zeros((b, t), np.int32)
  seg[0, 10:], seg[0, 25:] = 1, 2
  if b > 2:
    mask[2, -4:] = False
    seg[2, 20:] = 7
  return q, k, v, w, jnp.asarray(mask), (jnp.asarray(seg) if packed else None)


def _value_and_grads(impl, q, k, v, w, mask, seg, **kw):
  """attend's output and the gradients of sum(out * w) w.r.t. q, k, v."""
  def loss(q, k, v):
    out = attn.attend(q, k, v, token_mask=mask, segment_ids=seg, impl=impl, **kw)
    return jnp.sum(out * w), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def _assert_matches_xla(impl, q, k, v, w, mask, seg, **kw):
  ref, ref_grads = _value_and_grads("xla", q, k, v, w, mask, seg)
  out, grads = _value_and_grads(impl, q, k, v, w, mask, seg, **kw)
  np.testing.assert_allclose(out, ref, **TOL)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, err_msg=f"d{name}", **TOL)


@pytest.mark.parametrize("blocks, packed", [((8, 8), True), ((16, 8), True), ((8, 16), True),
                                            ((512, 512), True), ((8, 8), False)])
def test_chunked_matches_xla(blocks, packed):
  q, k, v, w, mask, seg = _inputs(packed=packed)
  _assert_matches_xla("chunked", q, k, v, w, mask, seg, block_q=blocks[0], block_k=blocks[1])


def test_chunked_bfloat16_is_as_close_to_float32_as_xla():
  """In bf16 neither backend matches f32 to 1e-5; chunked's error must not exceed xla's by > 25%."""
  q, k, v, w, mask, seg = _inputs()
  ref, ref_grads = _value_and_grads("xla", q, k, v, w, mask, seg)
  bf = lambda x: x.astype(jnp.bfloat16)
  err = {}
  for impl in ("xla", "chunked"):
    out, grads = _value_and_grads(impl, bf(q), bf(k), bf(v), w, mask, seg, block_q=8, block_k=8)
    err[impl] = [float(jnp.abs(a.astype(jnp.float32) - b).max()) for a, b in zip((out, *grads), (ref, *ref_grads))]
  assert all(c <= 1.25 * x + 1e-3 for c, x in zip(err["chunked"], err["xla"])), err


def test_chunked_under_jit_on_a_mesh():
  mesh = shd.make_mesh((2, 1, 2), jax.devices()[:4])
  q, k, v, w, mask, seg = _inputs(b=2, t=21, kh=2, r=2)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = (put(q, P("data", None, "tensor")), put(k, P("data", None, "tensor")), put(v, P("data", None, "tensor")),
          w, put(mask, P("data")), put(seg, P("data")))
  out, grads = _value_and_grads("chunked", *args, block_q=8, block_k=8)
  ref, ref_grads = _value_and_grads("xla", q, k, v, w, mask, seg)
  np.testing.assert_allclose(out, ref, **TOL)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, **TOL)


def test_padding_rows_are_zero_with_zero_gradients():
  q, k, v, _, mask, seg = _inputs()
  for impl in ("xla", "chunked"):
    out, (dq, dk, dv) = _value_and_grads(impl, q, k, v, jnp.ones_like(q), mask, seg, block_q=8, block_k=8)
    pad = ~np.asarray(mask)
    for x in (out, dq, dk, dv):
      assert np.isfinite(np.asarray(x)).all(), impl
    assert np.all(np.asarray(out)[pad] == 0), impl
    assert np.all(np.asarray(dq)[pad] == 0), impl
    assert np.all(np.asarray(dk)[pad] == 0) and np.all(np.asarray(dv)[pad] == 0), impl  # no query sees a pad


def test_fully_padded_row_is_finite():
  q, k, v, w, mask, _ = _inputs(packed=False)
  mask = mask.at[1].set(False)
  out, grads = _value_and_grads("chunked", q, k, v, w, mask, None, block_q=8, block_k=8)
  assert np.all(np.asarray(out)[1] == 0)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def _splash_or_skip(fn):
  try:
    return fn()
  except Exception as e:  # a JAX without the kernel, or one whose interpret mode cannot run it on CPU
    pytest.skip(f"splash attention does not run in interpret mode on CPU here: {type(e).__name__}: {e}")


def test_splash_interpret_matches_xla():
  q, k, v, w, mask, seg = _inputs(t=150)  # T padded to 256 inside: 2 blocks of 128
  _splash_or_skip(lambda: _value_and_grads("splash", q, k, v, w, mask, seg, block_q=128, interpret=True))
  _assert_matches_xla("splash", q, k, v, w, mask, seg, block_q=128, interpret=True)
  _assert_matches_xla("splash", q, k, v, w, mask, None, block_q=128, interpret=True)


def test_splash_under_shard_map_matches_xla():
  mesh = shd.make_mesh((2, 1, 2), jax.devices()[:4])
  q, k, v, w, mask, seg = _inputs(b=2, t=40, kh=2, r=2)

  def run():
    with shd.activate(mesh):
      return jax.jit(lambda *a: _value_and_grads("splash", *a, block_q=128, interpret=True))(q, k, v, w, mask, seg)
  out, grads = _splash_or_skip(run)
  ref, ref_grads = _value_and_grads("xla", q, k, v, w, mask, seg)
  np.testing.assert_allclose(out, ref, **TOL)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_wrapping_matches_xla(packed):
  """The cuDNN path's own work (real tokens moved to the front, lengths, segment mask), on CPU."""
  q, k, v, w, mask, seg = _inputs(packed=packed)
  ref, ref_grads = _value_and_grads("xla", q, k, v, w, mask, seg)

  def loss(q, k, v):
    out = attn._cudnn(q, k, v, mask, seg, implementation="xla")
    return jnp.sum(out * w), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(out, ref, **TOL)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, **TOL)


def test_backend_errors_name_the_config_field():
  q, k, v, _, mask, _ = _inputs()
  for impl in ("cudnn", "splash"):
    with pytest.raises(ConfigError, match=r"config\.model\.attention"):
      attn.attend(q, k, v, token_mask=mask, impl=impl)
  with pytest.raises(ConfigError, match=r"config\.model\.attention"):
    attn.attend(q, k, v, impl="flash")


def test_auto_on_cpu_picks_by_length():
  assert attn.resolve("auto", 512) == "xla"
  assert attn.resolve("auto", attn.AUTO_CHUNKED_MIN_TOKENS + 1) == "chunked"
  assert attn.resolve("chunked", 8) == "chunked"


# ---- the model -------------------------------------------------------------------------------

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
                   head_dim=8, qk_norm=True, attention_bias=True)


@pytest.fixture(scope="module")
def tiny_params():
  return init_params(TINY, jax.random.key(0))


def test_model_chunked_matches_xla(tiny_params):
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(0, 64, (3, 21)), jnp.int32)
  mask = np.ones((3, 21), bool)
  mask[1, :6] = False
  mask[2, -5:] = False
  mask = jnp.asarray(mask)
  pos = positions_from_mask(mask)
  logits = {}
  for impl in ("xla", "chunked"):
    cfg = TINY.replace(attention=impl)
    logits[impl] = np.asarray(apply_model(cfg, tiny_params, tokens, pos, mask).logits)
  m = np.asarray(mask)
  np.testing.assert_allclose(logits["chunked"][m], logits["xla"][m], **TOL)

  # Gradients through nn.remat + nn.scan (the learner's setting): the custom VJP inside both.
  def loss(params, impl):
    out = apply_model(TINY.replace(attention=impl, remat=True), params, tokens, pos, mask).logits
    return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(out), 0.0)) / 100
  grads = {impl: jax.grad(loss)(tiny_params, impl) for impl in ("xla", "chunked")}
  for path, g in jax.tree_util.tree_leaves_with_path(grads["chunked"]):
    ref = functools.reduce(lambda t, k: t[k.key], path, grads["xla"])
    np.testing.assert_allclose(g, ref, err_msg=jax.tree_util.keystr(path), **TOL)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_packed_row_matches_separate_sequences(tiny_params, impl):
  cfg = TINY.replace(attention=impl)
  rng = np.random.RandomState(1)
  a, b = rng.randint(0, 64, 9), rng.randint(0, 64, 7)
  sep = [np.asarray(apply_model(cfg, tiny_params, jnp.asarray(x[None], jnp.int32),
                                jnp.arange(len(x), dtype=jnp.int32)[None]).logits[0]) for x in (a, b)]
  tokens = jnp.asarray(np.concatenate([a, b, [0, 0]])[None], jnp.int32)   # two sequences and 2 pads
  positions = jnp.asarray(np.concatenate([np.arange(9), np.arange(7), [0, 0]])[None], jnp.int32)
  segments = jnp.asarray(np.array([0] * 9 + [1] * 7 + [2, 2])[None], jnp.int32)
  mask = jnp.asarray(np.array([True] * 16 + [False] * 2)[None])
  packed = np.asarray(apply_model(cfg, tiny_params, tokens, positions, mask, segment_ids=segments).logits[0])
  np.testing.assert_allclose(packed[:9], sep[0], **TOL)
  np.testing.assert_allclose(packed[9:16], sep[1], **TOL)


def test_model_config_attention_field():
  cfg = TINY.replace(attention="chunked")
  assert hash(cfg) != hash(TINY) and cfg != TINY
  plain = cfg.replace(qk_norm=False, attention_bias=False)   # a transformers Llama (export refuses TINY's mix)
  assert "attention" not in plain.to_hf()
  assert ModelConfig.from_hf(plain.to_hf(), "t").attention == "auto"   # a runtime choice, not a weight property
  with pytest.raises(ConfigError, match=r"model\.attention"):
    TINY.replace(attention="flash")


def test_user_config_attention_is_validated():
  from rljax import config as config_lib
  cfg = config_lib.base_config()
  assert cfg.model.attention == "auto"
  cfg.model.attention = "flash"
  with pytest.raises(ConfigError, match=r"config\.model\.attention"):
    config_lib.validate(cfg)
  assert set(ATTENTION_IMPLS) == set(attn.IMPLEMENTATIONS)


def _prefixed_inputs():
  """One row: a prompt (segment 1, tokens 0-9), two completions that continue it (segments 2 and 3,
  prefix segment 1), then an unrelated sequence (segment 4) with a padding token inside."""
  q, k, v, w = (x[:1] for x in _inputs(b=2, t=37, seed=3)[:4])
  seg = np.array([1] * 10 + [2] * 10 + [3] * 10 + [4] * 7, np.int32)
  pre = np.where((seg == 2) | (seg == 3), 1, seg).astype(np.int32)
  mask = np.ones(37, bool)
  mask[33] = False
  return q, k, v, w, jnp.asarray(mask[None]), jnp.asarray(seg[None]), jnp.asarray(pre[None])


def test_prefix_segment_equals_the_prompt_attended_in_one_row():
  """A completion that sees its prompt through `prefix_ids` gets the outputs it gets laid out right
  after that prompt in a row of its own (xla, the reference)."""
  q, k, v, _, mask, seg, pre = _prefixed_inputs()
  out = attn.attend(q, k, v, token_mask=mask, segment_ids=seg, prefix_ids=pre, impl="xla")
  for rows in (np.r_[0:10, 10:20], np.r_[0:10, 20:30]):
    alone = attn.attend(q[:, rows], k[:, rows], v[:, rows], impl="xla")
    np.testing.assert_allclose(out[:, rows[10:]], alone[:, 10:], **TOL)


@pytest.mark.parametrize("impl", ["chunked", "cudnn_wrapping"])
def test_prefix_segment_backends_match_xla(impl):
  q, k, v, w, mask, seg, pre = _prefixed_inputs()
  ref, ref_grads = _value_and_grads("xla", q, k, v, w, mask, seg, prefix_ids=pre)
  if impl == "chunked":
    out, grads = _value_and_grads("chunked", q, k, v, w, mask, seg, prefix_ids=pre, block_q=8, block_k=8)
  else:
    def loss(q, k, v):
      out = attn._cudnn(q, k, v, mask, seg, implementation="xla", prefix_ids=pre)
      return jnp.sum(out * w), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_allclose(out, ref, **TOL)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, err_msg=f"d{name}", **TOL)


def test_prefix_segments_are_refused_by_splash_by_name():
  q, k, v, _, mask, seg, pre = _prefixed_inputs()
  with pytest.raises(ConfigError, match=r"config\.train\.shared_prefix"):
    attn.attend(q, k, v, token_mask=mask, segment_ids=seg, prefix_ids=pre, impl="splash")


def test_auto_with_prefix_segments_is_chunked_on_accelerators(monkeypatch):
  """Prefix segments rule out splash and cuDNN; on TPU and GPU `auto` then takes the flash-style
  `chunked` at every length (xla's [T, T] scores took the 7B shared-prefix learner on v5p from 50.75 to
  86.22 GiB per chip at 2,048-token bins); on CPU it keeps its length rule."""
  for platform in ("tpu", "gpu"):
    monkeypatch.setattr(attn, "target_platform", lambda p=platform: p)
    assert attn.resolve("auto", 512, jnp.bfloat16, packed=True, prefixed=True) == "chunked"
  monkeypatch.setattr(attn, "target_platform", lambda: "cpu")
  assert attn.resolve("auto", 512, prefixed=True) == "xla"
  assert attn.resolve("auto", 4096, prefixed=True) == "chunked"
