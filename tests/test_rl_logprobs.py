"""chunked_logprobs equals the naive full log-softmax (values and gradients) without its memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.rl import chunked_logprobs, naive_logprobs

B, T, D, V = 2, 5, 16, 37


def _inputs(seed=0, scale=1.0, dtype=jnp.float32):
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  hidden = (jax.random.normal(k1, (B, T, D)) * scale).astype(dtype)
  lm_head = (jax.random.normal(k2, (D, V)) * 0.5).astype(dtype)
  targets = jax.random.randint(k3, (B, T), 0, V)
  cot = jax.random.normal(k4, (2, B, T))
  return hidden, lm_head, targets, cot


def _vjp(fn, hidden, lm_head, cot):
  """(lp, ent) and their pullback of `cot`, as one compiled program."""
  def run(hidden, lm_head, cot):
    (lp, ent), pullback = jax.vjp(fn, hidden, lm_head)
    return lp, ent, pullback((cot[0], cot[1]))
  return jax.jit(run)(hidden, lm_head, cot)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_chunked_equals_naive_values_and_grads():
  hidden, lm_head, targets, cot = _inputs()
  temp = 0.7
  naive = _vjp(lambda h, w: naive_logprobs(h, w, targets, temp), hidden, lm_head, cot)
  # chunk 8 leaves a partial last chunk (37 = 4 * 8 + 5); 64 > V is clamped to one chunk.
  for chunk in (8, 64):
    chunked = _vjp(lambda h, w: chunked_logprobs(h, w, targets, temp, chunk_size=chunk),
                   hidden, lm_head, cot)
    assert chunked[0].dtype == jnp.float32 and chunked[1].dtype == jnp.float32
    np.testing.assert_allclose(chunked[0], naive[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked[1], naive[1], rtol=1e-5, atol=1e-5)
    for got, want in zip(chunked[2], naive[2]):
      assert got.shape == want.shape and got.dtype == want.dtype
      assert _rel(got, want) < 1e-5, chunk


def test_large_logits_stay_finite():
  hidden, lm_head, targets, cot = _inputs(seed=1, scale=300.0)  # logits in the thousands
  lp, ent, (dh, dw) = _vjp(lambda h, w: chunked_logprobs(h, w, targets, chunk_size=8),
                           hidden, lm_head, cot)
  n_lp, n_ent, (n_dh, n_dw) = _vjp(lambda h, w: naive_logprobs(h, w, targets), hidden, lm_head,
                                   cot)
  for x in (lp, ent, dh, dw):
    assert np.all(np.isfinite(np.asarray(x)))
  assert np.all(np.asarray(ent) >= -1e-4)
  np.testing.assert_allclose(lp, n_lp, rtol=1e-5, atol=1e-2)
  assert _rel(dw, n_dw) < 1e-4


def test_bfloat16_inputs():
  hidden, lm_head, targets, cot = _inputs(dtype=jnp.bfloat16)
  lp, ent, (dh, dw) = _vjp(lambda h, w: chunked_logprobs(h, w, targets, chunk_size=8),
                           hidden, lm_head, cot)
  n_lp, n_ent, (n_dh, n_dw) = _vjp(lambda h, w: naive_logprobs(h, w, targets), hidden, lm_head,
                                   cot)
  assert lp.dtype == jnp.float32 and dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  np.testing.assert_allclose(lp, n_lp, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ent, n_ent, rtol=1e-5, atol=1e-4)
  assert _rel(dh, n_dh) < 2e-2 and _rel(dw, n_dw) < 2e-2  # bf16 rounding of the outputs


def test_peak_memory_below_naive():
  """Compiled temp memory of value-and-grad, naive vs chunked (no [B, T, V] fp32 array)."""
  b, t, d, v, chunk = 2, 64, 32, 8192, 512
  hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  lm_head = jax.ShapeDtypeStruct((d, v), jnp.float32)
  targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def loss(fn):
    return jax.value_and_grad(lambda h, w, y: sum(jnp.sum(x) for x in fn(h, w, y)), (0, 1))

  def temp_bytes(fn):
    compiled = jax.jit(loss(fn)).lower(hidden, lm_head, targets).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  naive = temp_bytes(naive_logprobs)
  chunked = temp_bytes(lambda h, w, y: chunked_logprobs(h, w, y, chunk_size=chunk))
  full_logits = b * t * v * 4
  assert naive >= full_logits
  assert chunked < full_logits / 4
  assert chunked < naive / 8


def test_bad_shapes():
  hidden, lm_head, targets, _ = _inputs()
  with pytest.raises(ValueError, match="lm_head"):
    chunked_logprobs(hidden, lm_head.T, targets)
  with pytest.raises(ValueError, match="targets"):
    chunked_logprobs(hidden, lm_head, targets[:, :2])
  with pytest.raises(ValueError, match="temperature"):
    chunked_logprobs(hidden, lm_head, targets, temperature=0.0)
