"""Per-token log-probs and entropies from hidden states, chunked over the vocabulary.

`chunked_logprobs` never materialises the `[B, T, V]` fp32 logits: the forward pass streams
vocabulary chunks of `[B*T, C]` through an online log-sum-exp, and a custom VJP recomputes each
chunk's logits in the backward pass. Peak temporary memory is O(B*T*C) instead of O(B*T*V)
(figures in docs/loss.md, measured by scripts/bench_logprobs_memory.py).

On a mesh (passed, or put in scope by `rljax.sharding.activate`) the computation runs inside
`jax.shard_map`: each device streams the chunks of its own rows (batch axes) and of its own
vocabulary shard (`tensor`), and the loops hold no collective. The forward combines the
per-shard log-sum-exp statistics once after the loop (a max and three sums over `tensor`), the
backward sums dh over `tensor` and dW over the batch axes once after the loop. A collective
inside the chunk loop, as XLA's partitioner placed one when it split the contraction over the
fsdp-sharded hidden dimension, made the fused step deadlock on CPU meshes such as (1, 8, 1):
XLA:CPU runs independent thunks concurrently on a shared pool whose threads block inside a
collective, so a device still in the loop and seven devices already in the next all-reduce
could hold every thread (measured: 3 of 3 runs on jax 0.10.2).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from rljax.rl._sharding import replicate, replicated_sharding

_F32 = jnp.float32


def naive_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array,
                   temperature: float = 1.0, softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Reference implementation that materialises the full fp32 log-softmax.

  Args:
    hidden: [B, T, D] any float dtype.
    lm_head: [D, V].
    targets: [B, T] int.
    temperature: logits are divided by it.
    softcap: None, or c: the logits z become c * tanh(z / c) first (Gemma's final soft-capping).

  Returns:
    lp: [B, T] float32 log p(target); ent: [B, T] float32 entropy.
  """
  logits = jnp.einsum("btd,dv->btv", hidden, lm_head, preferred_element_type=_F32)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  lp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return lp, ent


def chunked_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array,
                     temperature: float = 1.0, chunk_size: int = 4096,
                     precision=None, mesh=None, softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
  """log p(target) and entropy of softmax(cap(hidden @ lm_head) / temperature), in fp32.

  Equal (values and gradients, to fp32 rounding) to `naive_logprobs`, without the `[B, T, V]`
  fp32 array. The matmuls take the inputs' dtypes and accumulate in fp32.

  Args:
    hidden: [B, T, D] any float dtype; receives a gradient (cast back to its dtype).
    lm_head: [D, V] the unembedding kernel (for tied embeddings pass embedding.T); receives a
      gradient in its own dtype.
    targets: [B, T] int in [0, V); values outside give meaningless (finite) results, so mask
      those positions out downstream.
    temperature: Python float > 0 (static): the sampling temperature.
    chunk_size: vocabulary columns per chunk (static). Peak temporary memory is a few
      [B*T, chunk_size] fp32 arrays.
    precision: optional `jax.lax.Precision` for the matmuls.
    mesh: a (data, fsdp, tensor) Mesh to compute on per shard (module doc); default the mesh
      `rljax.sharding.activate` put in scope, if any. Rows are split over the batch axes that
      divide B, vocabulary columns over `tensor` when it divides V.
    softcap: None (cap is the identity), or a Python float c > 0 (static): the logits z become
      c * tanh(z / c) before the temperature, as the model's own logits (Gemma's
      final_logit_softcap); the backward multiplies by 1 - tanh(z / c) ** 2.

  Returns:
    lp: [B, T] float32; ent: [B, T] float32.
  """
  if hidden.ndim != 3:
    raise ValueError(f"hidden must be [B, T, D], got shape {hidden.shape}.")
  if lm_head.ndim != 2 or lm_head.shape[0] != hidden.shape[-1]:
    raise ValueError(
        f"lm_head must be [D, V] with D = {hidden.shape[-1]} (hidden's last axis), got shape "
        f"{lm_head.shape}; for tied embeddings pass embedding.T.")
  if targets.shape != hidden.shape[:2]:
    raise ValueError(f"targets must be [B, T] = {hidden.shape[:2]}, got {targets.shape}.")
  temperature = float(temperature)
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}.")
  if int(chunk_size) < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size}.")
  if softcap is not None:
    softcap = float(softcap)
    if not softcap > 0:
      raise ValueError(f"softcap must be None or > 0, got {softcap}.")
  b, t, d = hidden.shape
  if mesh is None:
    from rljax.sharding import active_mesh
    mesh = active_mesh()
  if mesh is not None and mesh.size > 1:
    return _sharded_logprobs(hidden, lm_head, targets, 1.0 / temperature, int(chunk_size), precision, mesh, softcap)
  chunk = min(int(chunk_size), lm_head.shape[1])
  # Under explicit sharding the vocabulary loop needs the whole kernel on every device.
  lm_head = replicate(lm_head)
  lp, ent = _lp_ent(hidden.reshape(b * t, d), lm_head, targets.reshape(b * t).astype(jnp.int32),
                    1.0 / temperature, chunk, precision, softcap)
  return lp.reshape(b, t), ent.reshape(b, t)


def _chunk(h, w, i, inv_temp, chunk, precision, softcap=None):
  """Logits of vocabulary chunk i: z [N, C] fp32 (soft-capped, then divided by the temperature),
  column ids [C], fresh [C] bool, w_c [D, C], start, and slope [N, C], dz/d(h.w) / inv_temp = 1 -
  tanh^2 of the soft-cap (None without one).

  The last chunk is shifted left to stay inside V (no padded copy of lm_head); the columns it
  shares with the previous chunk are marked not fresh and ignored.
  """
  v = w.shape[1]
  start = jnp.minimum(i * chunk, v - chunk)
  w_c = lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
  z = jnp.dot(h, w_c, preferred_element_type=_F32, precision=precision).astype(_F32)
  slope = None
  if softcap is not None:
    th = jnp.tanh(z / softcap)
    z, slope = softcap * th, 1.0 - th * th
  cols = start + jnp.arange(chunk)
  return z * inv_temp, cols, cols >= i * chunk, w_c, start, slope


def _forward_stats(h, w, y, inv_temp, chunk, precision, softcap=None):
  """Online log-sum-exp over the chunks of w's columns: (m, s, u, zt), each [N] float32.

  m: max logit; s: sum exp(z - m); u: sum exp(z - m) (z - m); zt: the target's logit, 0 for
  rows whose target is not among w's columns (y outside [0, V)).
  """
  num_chunks = math.ceil(w.shape[1] / chunk)

  def body(carry, i):
    m, s, u, zt = carry
    z, cols, fresh, _, _, _ = _chunk(h, w, i, inv_temp, chunk, precision, softcap)
    z = jnp.where(fresh, z, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    alpha = jnp.exp(m - m_new)
    shift = jnp.where(s > 0, m - m_new, 0.0)  # avoids 0 * -inf on the first chunk
    e = jnp.exp(z - m_new[:, None])
    zc = jnp.where(fresh, z - m_new[:, None], 0.0)
    u = alpha * (u + s * shift) + jnp.sum(e * zc, axis=-1)
    s = alpha * s + jnp.sum(e, axis=-1)
    hit = (cols[None, :] == y[:, None]) & fresh
    zt = zt + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    return (m_new, s, u, zt), None

  # Carries built from h keep its (batch) sharding, as lax.scan requires.
  zero = jnp.zeros_like(h[:, 0], dtype=_F32)
  init = (zero - jnp.inf, zero, zero, zero)
  (m, s, u, zt), _ = lax.scan(body, init, jnp.arange(num_chunks))
  return m, s, u, zt


def _finish(m, s, u, zt):
  """lp, ent, lse [N] from the log-sum-exp statistics."""
  log_s = jnp.log(s)
  lse = m + log_s
  return zt - lse, log_s - u / s, lse


def _forward(h, w, y, inv_temp, chunk, precision, softcap=None):
  """lp [N], ent [N], lse [N] over all of w's columns."""
  return _finish(*_forward_stats(h, w, y, inv_temp, chunk, precision, softcap))


def _backward(h, w, y, lse, ent, g_lp, g_ent, inv_temp, chunk, precision, w_sharding=None, softcap=None):
  """Recomputes each chunk's logits; d lp/dz = onehot - p, d ent/dz = -p (log p + ent).

  Returns dh [N, D] float32 and dw like w. `lse` and `ent` are over the whole vocabulary, so w
  may be one shard of its columns (y then holds shard-local column ids).
  """
  num_chunks = math.ceil(w.shape[1] / chunk)

  def body(carry, i):
    dh, dw = carry
    z, cols, fresh, w_c, start, slope = _chunk(h, w, i, inv_temp, chunk, precision, softcap)
    logp = z - lse[:, None]
    p = jnp.where(fresh, jnp.exp(logp), 0.0)
    hit = ((cols[None, :] == y[:, None]) & fresh).astype(_F32)
    g_z = g_lp[:, None] * (hit - p) - g_ent[:, None] * p * (logp + ent[:, None])
    g_z = g_z * inv_temp
    if slope is not None:   # through the soft-cap: d(c tanh(x / c)) / dx = 1 - tanh^2
      g_z = g_z * slope
    dh = dh + jnp.dot(g_z, w_c.T, preferred_element_type=_F32, precision=precision)
    dw_c = jnp.dot(h.T, g_z, preferred_element_type=_F32, precision=precision,
                   out_sharding=w_sharding)
    # Each column is written once (stale overlap columns get + 0), so accumulating in w's
    # dtype is exact up to the one cast.
    old = lax.dynamic_slice_in_dim(dw, start, chunk, axis=1)
    dw = lax.dynamic_update_slice_in_dim(dw, old + dw_c.astype(dw.dtype), start, axis=1)
    return (dh, dw), None

  init = (jnp.zeros_like(h, dtype=_F32), jnp.zeros_like(w))
  (dh, dw), _ = lax.scan(body, init, jnp.arange(num_chunks))
  return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _lp_ent(h, w, y, inv_temp, chunk, precision, softcap):
  """h [N, D], w [D, V], y [N] -> (lp [N], ent [N]) float32."""
  lp, ent, _ = _forward(h, w, y, inv_temp, chunk, precision, softcap)
  return lp, ent


def _lp_ent_fwd(h, w, y, inv_temp, chunk, precision, softcap):
  lp, ent, lse = _forward(h, w, y, inv_temp, chunk, precision, softcap)
  return (lp, ent), (h, w, y, lse, ent)


def _lp_ent_bwd(inv_temp, chunk, precision, softcap, res, cts):
  h, w, y, lse, ent = res
  g_lp, g_ent = cts
  # Under explicit sharding the sum over (sharded) tokens gives a replicated dW.
  dh, dw = _backward(h, w, y, lse, ent, g_lp, g_ent, inv_temp, chunk, precision, replicated_sharding(w),
                     softcap=softcap)
  return dh.astype(h.dtype), dw, None


_lp_ent.defvjp(_lp_ent_fwd, _lp_ent_bwd)


# ---- per shard, on a mesh ----------------------------------------------------------------------


def _layout(mesh, b: int, v: int):
  """(row axes, vocab axis): the batch axes that divide B, and `tensor` when it divides V."""
  from rljax.sharding import logical_to_spec
  rows = logical_to_spec(("batch",), (b,), mesh)[0]
  rows = () if rows is None else ((rows,) if isinstance(rows, str) else tuple(rows))
  tp = mesh.shape.get("tensor", 1)
  vocab = "tensor" if tp > 1 and v % tp == 0 else None
  return rows, vocab


def _sharded_logprobs(hidden, lm_head, targets, inv_temp, chunk_size, precision, mesh, softcap=None):
  """chunked_logprobs per shard of `mesh` (module doc). hidden [B, T, D] -> lp, ent [B, T]."""
  b, t, d = hidden.shape
  rows, vocab = _layout(mesh, b, lm_head.shape[1])
  local_v = lm_head.shape[1] // (mesh.shape[vocab] if vocab else 1)
  chunk = min(chunk_size, local_v)
  lp, ent = _sharded_lp_ent(hidden.reshape(b * t, d), lm_head, targets.reshape(b * t).astype(jnp.int32),
                            (inv_temp, chunk, precision, mesh, rows, vocab, softcap))
  return lp.reshape(b, t), ent.reshape(b, t)


def _specs(static):
  from jax.sharding import PartitionSpec as P
  _, _, _, _, rows, vocab, _ = static
  r = rows if rows else None
  return P(r, None), P(None, vocab), P(r)


def _local_forward(static, h, w, y):
  """One shard: its rows against its vocabulary columns, then the statistics combined over `tensor`."""
  inv_temp, chunk, precision, _, _, vocab, softcap = static
  offset = lax.axis_index(vocab) * w.shape[1] if vocab else 0
  m, s, u, zt = _forward_stats(h, w, y - offset, inv_temp, chunk, precision, softcap)
  if vocab:
    m_all = lax.pmax(m, vocab)
    scale = jnp.exp(m - m_all)
    s, u = lax.psum(s * scale, vocab), lax.psum(scale * (u + s * (m - m_all)), vocab)
    zt, m = lax.psum(zt, vocab), m_all
  return _finish(m, s, u, zt)


def _sharded_forward(static, h, w, y):
  hs, ws, ys = _specs(static)
  # check_vma=False: the loop carries start from h's rows and take in w's vocabulary shard; the
  # outputs are replicated over `tensor` by the psums above, as out_specs say.
  return jax.shard_map(functools.partial(_local_forward, static), mesh=static[3], in_specs=(hs, ws, ys),
                       out_specs=(ys, ys, ys), check_vma=False)(h, w, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sharded_lp_ent(h, w, y, static):
  """h [N, D], w [D, V], y [N] -> (lp [N], ent [N]) float32, per shard of static's mesh."""
  lp, ent, _ = _sharded_forward(static, h, w, y)
  return lp, ent


def _sharded_fwd(h, w, y, static):
  lp, ent, lse = _sharded_forward(static, h, w, y)
  return (lp, ent), (h, w, y, lse, ent)


def _sharded_bwd(static, res, cts):
  inv_temp, chunk, precision, mesh, rows, vocab, softcap = static
  h, w, y, lse, ent = res
  g_lp, g_ent = cts
  hs, ws, ys = _specs(static)

  def local(h, w, y, lse, ent, g_lp, g_ent):
    offset = lax.axis_index(vocab) * w.shape[1] if vocab else 0
    dh, dw = _backward(h, w, y - offset, lse, ent, g_lp, g_ent, inv_temp, chunk, precision, softcap=softcap)
    if vocab:
      dh = lax.psum(dh, vocab)      # each vocabulary shard's part of dh
    if rows:
      dw = lax.psum(dw, rows)       # each row shard's part of dW
    return dh.astype(h.dtype), dw

  dh, dw = jax.shard_map(local, mesh=mesh, in_specs=(hs, ws, ys, ys, ys, ys, ys), out_specs=(hs, ws),
                         check_vma=False)(h, w, y, lse, ent, g_lp, g_ent)
  return dh, dw, None


_sharded_lp_ent.defvjp(_sharded_fwd, _sharded_bwd)
