"""Causal self-attention without a KV cache (the learner's forward), with a choice of backends.

Shapes: B = batch, T = tokens (queries and keys are the same tokens), K = KV heads, R = query
heads per KV head (H = K * R, query head h uses KV head h // R), Dh = head dim.

Which key a query sees is described by O(B * T) inputs, never by a [B, T, T] array:

- causal by index order: query t sees keys s <= t of its row;
- `token_mask` [B, T] bool: padding on either side (or anywhere); masked tokens are never seen;
- `segment_ids` [B, T] int32 (None = one segment per row): packed rows, a token sees only keys
  of its own segment. Positions (RoPE) are applied before this module, so a packed segment
  restarts its positions where the caller says.
- `prefix_ids` [B, T] int32 (with segment ids; None = none): a token also sees the keys of segment
  `prefix_ids[t]`, e.g. the one copy of a prompt that several packed completions continue (the
  shared-prefix learner, trainer/packing.py). `xla`, `chunked` and `cudnn` take it; `splash`
  does not (its segments are equality only), and `auto` picks chunked or xla for it.

A query whose `token_mask` is False returns zeros (and passes no gradient), in every backend.

Gemma's extras: `scale` (the factor on q.k instead of 1 / sqrt(Dh); every backend), `softcap`
(scores become cap * tanh(s / cap) before masking) and `window` with `positions` (a sliding
window: a query at position p sees keys at positions > p - window). Soft-capping and windows are
implemented by `xla` and `chunked`; `auto` picks one of those two when either is asked for, and
`cudnn` / `splash` raise a ConfigError naming config.model.attention.

Backends (`ModelConfig.attention`, `config.model.attention`):

- `xla`: full [B, K, R, T, T] scores, the reference (memory grows with T^2);
- `chunked`: flash-style blocks with an online softmax in pure JAX, any backend; a custom VJP
  recomputes the blocks in the backward pass, so nothing T x T is ever stored;
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (GPU, bf16/fp16);
- `splash`: the Pallas TPU splash-attention kernel (TPU; interpret mode elsewhere, for tests);
- `auto`: splash on TPU (on several devices only when traced under `rljax.sharding.activate`, which
  it needs for its shard_map; chunked otherwise), cuDNN on GPU (bf16/fp16, no segment ids), else
  chunked above `AUTO_CHUNKED_MIN_TOKENS` tokens and xla at or below.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models.config import ATTENTION_IMPLS as IMPLEMENTATIONS

AUTO_CHUNKED_MIN_TOKENS = 2048   # `auto` off TPU/GPU: chunked above this many tokens, xla at or below
DEFAULT_BLOCK = 512              # chunked / splash block (queries and keys)
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_PAD_SEGMENT = int(np.iinfo(np.int32).min)   # splash: padding's own segment (never a real id)


def resolve(impl: str, length: int, dtype=jnp.float32, packed: bool = False, masking: bool = False,
            prefixed: bool = False) -> str:
  """The concrete backend for `impl` on the target platform (`target_platform`) at `length` tokens.

  masking: soft-capping or a sliding window is needed (Gemma), which only xla and chunked do.
  prefixed: tokens also see a shared prefix segment (`prefix_ids`), which splash does not do.
  """
  if impl not in IMPLEMENTATIONS:
    raise ConfigError(f"config.model.attention={impl!r} is not one of {IMPLEMENTATIONS}.")
  if impl == "splash" and prefixed:
    raise ConfigError("config.model.attention='splash' cannot attend to a shared prefix (its segments are "
                      "equality only): set config.train.shared_prefix=False or config.model.attention to "
                      "'auto', 'chunked' or 'xla'.")
  if impl != "auto":
    return impl
  backend = target_platform()
  if prefixed and backend in ("tpu", "gpu"):   # in place of splash / cuDNN: flash-style, no [T, T] scores
    return "chunked"
  if masking or prefixed:
    return "chunked" if length > AUTO_CHUNKED_MIN_TOKENS else "xla"
  if backend == "tpu":  # splash needs shard_map on several devices: only with the mesh in context
    return "splash" if jax.device_count() == 1 or _context_mesh() is not None else "chunked"
  if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and not packed:
    return "cudnn"
  return "chunked" if length > AUTO_CHUNKED_MIN_TOKENS else "xla"


def attend(q, k, v, *, token_mask=None, segment_ids=None, impl: str = "auto", block_q: int = DEFAULT_BLOCK,
           block_k: int = DEFAULT_BLOCK, interpret: bool | None = None, positions=None, window=None,
           scale: float | None = None, softcap: float | None = None, prefix_ids=None):
  """Causal self-attention of T tokens. Returns [B, T, K, R, Dh] in q's dtype.

  q: [B, T, K, R, Dh]; k, v: [B, T, K, Dh]; token_mask: [B, T] bool (None = all real);
  segment_ids: [B, T] int32 (None = one segment per row). Scores are multiplied by `scale` (a
  Python float; None, the default, divides them by sqrt(Dh)) and computed in float32; with `softcap`
  (a Python float) they become softcap * tanh(s / softcap) before masking. window: None, or an int32 scalar (may be
  traced: a layer's flag picks it) with positions [B, T] int32: a query sees only keys whose
  position is > its own minus window. prefix_ids: [B, T] int32 or None, the segment each token may
  also see (module docstring; needs segment_ids). block_q / block_k: chunked's block sizes (splash uses
  block_q); T need not be a multiple of them. interpret: run splash in Pallas interpret mode
  (None = only where it must, which is an error off TPU: interpret mode is for tests).
  """
  b, t = q.shape[:2]
  if k.shape[1] != t:
    raise ValueError(f"attend is self-attention: q has {t} tokens, k has {k.shape[1]}.")
  if token_mask is None:
    token_mask = jnp.ones((b, t), bool)
  if window is not None and positions is None:
    raise ValueError("attend: a sliding `window` needs the tokens' `positions` [B, T].")
  scale = None if scale is None else float(scale)
  masking = window is not None or softcap is not None
  if prefix_ids is not None and segment_ids is None:
    raise ValueError("attend: prefix_ids name segments, so they need segment_ids.")
  impl = resolve(impl, t, q.dtype, segment_ids is not None, masking, prefix_ids is not None)
  if impl == "xla":
    return _xla(q, k, v, token_mask, segment_ids, positions, window, scale, softcap, prefix_ids)
  if impl == "chunked":
    return _chunked(q, k, v, token_mask, segment_ids, block_q, block_k, positions, window, scale, softcap,
                    prefix_ids)
  if masking:
    raise ConfigError(f"config.model.attention={impl!r} implements neither attention soft-capping nor sliding "
                      "windows, which this model (Gemma) needs; set config.model.attention to 'auto', 'chunked' "
                      "or 'xla'.")
  if impl == "cudnn":
    return _cudnn(q, k, v, token_mask, segment_ids, scale=scale, prefix_ids=prefix_ids)
  return _splash(q, k, v, token_mask, segment_ids, block_q, interpret, scale)


def _valid_rows(out, token_mask):
  """Zeros the rows of padding queries: [B, T, K, R, Dh]."""
  return jnp.where(token_mask[:, :, None, None, None], out, jnp.zeros((), out.dtype))


# ---- xla: the reference -------------------------------------------------------------------------

def soft_cap(s, cap):
  """cap * tanh(s / cap) (Gemma's soft-capping of scores); s itself when cap is None."""
  return s if cap is None else cap * jnp.tanh(s / cap)


def scale_scores(s, scale, dh):
  """Scores s times `scale`, or divided by sqrt(dh) when scale is None (the default's exact bits)."""
  return s / math.sqrt(dh) if scale is None else s * scale


def _segment_mask(q_seg, k_seg, q_prefix):
  """[B, Tq, Tk] bool: a query sees a key of its own segment, or of its prefix segment (q_prefix, or None)."""
  same = q_seg[:, :, None] == k_seg[:, None, :]
  return same if q_prefix is None else same | (q_prefix[:, :, None] == k_seg[:, None, :])


def _xla(q, k, v, token_mask, segment_ids, positions=None, window=None, scale=None, softcap=None, prefix_ids=None):
  """Full scores [B, K, R, T, T] in float32 and a [B, T, T] mask; memory grows with T^2."""
  t, dh = q.shape[1], q.shape[-1]
  mask = jnp.tril(jnp.ones((t, t), bool))[None] & token_mask[:, None, :]  # [B, T, S]
  if segment_ids is not None:
    mask = mask & _segment_mask(segment_ids, segment_ids, prefix_ids)
  if window is not None:
    mask = mask & ((positions[:, :, None] - positions[:, None, :]) < window)
  scores = jnp.einsum("btkrd,bskd->bkrts", q, k, preferred_element_type=jnp.float32)  # [B, K, R, T, S]
  scores = jnp.where(mask[:, None, None, :, :], soft_cap(scale_scores(scores, scale, dh), softcap), _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkrts,bskd->btkrd", probs, v)  # [B, T, K, R, Dh]
  return _valid_rows(out, token_mask)


# ---- chunked: blockwise online softmax with a recomputing backward ---------------------------------

def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_axis(x, length: int, axis: int, value=0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _chunked(q, k, v, token_mask, segment_ids, block_q, block_k, positions=None, window=None, scale=None,
             softcap=None, prefix_ids=None):
  """Pads T up to the blocks, runs `_flash` in the [B, K, T, R, Dh] layout, slices back."""
  b, t, kh, r, dh = q.shape
  bq, bk = min(block_q, t), min(block_k, t)
  tq, tk = _round_up(t, bq), _round_up(t, bk)
  if segment_ids is None:
    segment_ids = jnp.zeros((b, t), jnp.int32)
  q_pos = k_pos = None   # no window: no position test in the blocks
  if window is not None:
    window = jnp.asarray(window, jnp.int32)
    q_pos, k_pos = _pad_axis(positions.astype(jnp.int32), tq, 1), _pad_axis(positions.astype(jnp.int32), tk, 1)
  qt = _pad_axis(q.transpose(0, 2, 1, 3, 4), tq, 2)  # [B, K, Tq, R, Dh]
  kt = _pad_axis(k.transpose(0, 2, 1, 3), tk, 2)     # [B, K, Tk, Dh]
  vt = _pad_axis(v.transpose(0, 2, 1, 3), tk, 2)
  q_valid, k_valid = _pad_axis(token_mask, tq, 1, False), _pad_axis(token_mask, tk, 1, False)
  q_seg, k_seg = _pad_axis(segment_ids, tq, 1), _pad_axis(segment_ids, tk, 1)
  q_pre = None if prefix_ids is None else _pad_axis(prefix_ids, tq, 1)
  out = _flash(qt, kt, vt, (q_valid, k_valid, q_seg, k_seg, q_pre, q_pos, k_pos, window), bq, bk, scale, softcap)
  return out[:, :, :t].transpose(0, 2, 1, 3, 4)


def _block_mask(i, j, bq, bk, masks):
  """[B, 1, bq, 1, bk] bool: query block i may see key block j (causal, padding, segments, window).

  masks: (q_valid, k_valid, q_seg, k_seg, q_pre, q_pos, k_pos, window) as `_flash` takes them (q_pre
  None without prefix segments, the last three None without a sliding window).
  """
  q_valid, k_valid, q_seg, k_seg, q_pre, q_pos, k_pos, window = masks
  qi = i * bq + jnp.arange(bq)
  kj = j * bk + jnp.arange(bk)
  q_rows = lambda x: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1)
  k_rows = lambda x: jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1)
  qv, kv, qs, ks = q_rows(q_valid), k_rows(k_valid), q_rows(q_seg), k_rows(k_seg)
  qp = None if q_pre is None else q_rows(q_pre)
  mask = (kj[None, :] <= qi[:, None])[None] & qv[:, :, None] & kv[:, None, :] & _segment_mask(qs, ks, qp)
  if window is not None:
    mask = mask & ((q_rows(q_pos)[:, :, None] - k_rows(k_pos)[:, None, :]) < window)
  return mask[:, None, :, None, :]


def _block_scores(q, k, i, j, bq, bk, scale, softcap):
  """Scaled (and soft-capped) float32 scores of query block i against key block j, [B, K, bq, R, bk],
  and their derivative with respect to the scaled scores (None without soft-capping)."""
  qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=2)
  kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
  s = scale_scores(jnp.einsum("bkqrd,bksd->bkqrs", qi, kj, preferred_element_type=jnp.float32), scale, q.shape[-1])
  if softcap is None:
    return s, None
  th = jnp.tanh(s / softcap)
  return softcap * th, 1.0 - th * th


def _last_key_block(i, bq, bk, num_k):
  """1 + the last key block that query block i can see causally."""
  return jnp.minimum(((i + 1) * bq - 1) // bk + 1, num_k)


def _flash_forward(q, k, v, masks, bq, bk, scale, softcap):
  """out [B, K, Tq, R, Dh] (q's dtype) and lse [B, K, Tq, R] float32 (0 on rows that see nothing).

  Query blocks in turn; for each, the key blocks up to the diagonal in turn, carrying the running
  max m, the running sum l and the unnormalised output acc ([B, K, bq, R(, Dh)], float32).
  """
  b, kh, tq, r, dh = q.shape
  num_q, num_k = tq // bq, k.shape[2] // bk

  def q_block(i, carry):
    out, lse = carry

    def k_block(j, state):
      m, denom, acc = state
      mask = _block_mask(i, j, bq, bk, masks)
      s = jnp.where(mask, _block_scores(q, k, i, j, bq, bk, scale, softcap)[0], _MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # [B, K, bq, R, bk]
      corr = jnp.exp(m - m_new)
      vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
      pv = jnp.einsum("bkqrs,bksd->bkqrd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
      return m_new, denom * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((b, kh, bq, r), _MASK_VALUE, jnp.float32), jnp.zeros((b, kh, bq, r), jnp.float32),
            jnp.zeros((b, kh, bq, r, dh), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(0, _last_key_block(i, bq, bk, num_k), k_block, init)
    seen = denom > 0
    o = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
    lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
    out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), i * bq, axis=2)
    return out, jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * bq, axis=2)

  init = (jnp.zeros(q.shape, q.dtype), jnp.zeros((b, kh, tq, r), jnp.float32))
  return jax.lax.fori_loop(0, num_q, q_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, masks, bq, bk, scale, softcap):
  """q: [B, K, Tq, R, Dh]; k, v: [B, K, Tk, Dh]; masks: (q_valid, k_valid, q_seg, k_seg, q_pre, q_pos,
  k_pos, window): q_valid, q_seg, q_pre, q_pos [B, Tq]; k_valid, k_seg, k_pos [B, Tk]; window [] int32
  (q_pre None without prefix segments; q_pos, k_pos, window None without a sliding window).

  Tq, Tk are multiples of bq, bk. scale, softcap: Python floats (softcap may be None).
  Returns [B, K, Tq, R, Dh].
  """
  return _flash_forward(q, k, v, masks, bq, bk, scale, softcap)[0]


def _flash_fwd(q, k, v, masks, bq, bk, scale, softcap):
  out, lse = _flash_forward(q, k, v, masks, bq, bk, scale, softcap)
  return out, (q, k, v, masks, out, lse)


def _flash_bwd(bq, bk, scale, softcap, res, dout):
  """Key blocks in turn; for each, the query blocks from the diagonal on, recomputing p.

  dk, dv of the key block are carried ([B, K, bk, Dh] float32); dq [B, K, Tq, R, Dh] float32 is
  accumulated in place. Rows that saw nothing have p = 0, so they pass no gradient.
  """
  q, k, v, masks, out, lse = res
  b, kh, tq, r, dh = q.shape
  num_q, num_k = tq // bq, k.shape[2] // bk
  ds_scale = 1.0 / math.sqrt(dh) if scale is None else scale
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, K, Tq, R]

  def k_block(j, carry):
    dq, dk, dv = carry
    kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)

    def q_block(i, state):
      dq, dkj, dvj = state
      mask = _block_mask(i, j, bq, bk, masks)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=2)
      s, slope = _block_scores(q, k, i, j, bq, bk, scale, softcap)
      p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)  # [B, K, bq, R, bk]
      qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=2)
      doi = jax.lax.dynamic_slice_in_dim(dout, i * bq, bq, axis=2)
      dvj = dvj + jnp.einsum("bkqrs,bkqrd->bksd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkqrd,bksd->bkqrs", doi, vj, preferred_element_type=jnp.float32)
      ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=2)[..., None]) * ds_scale
      if slope is not None:   # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        ds = ds * slope
      dqi = jnp.einsum("bkqrs,bksd->bkqrd", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=2) + dqi, i * bq, axis=2)
      dkj = dkj + jnp.einsum("bkqrs,bkqrd->bksd", ds.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
      return dq, dkj, dvj

    zeros = jnp.zeros((b, kh, bk, dh), jnp.float32)
    dq, dkj, dvj = jax.lax.fori_loop((j * bk) // bq, num_q, q_block, (dq, zeros, zeros))
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * bk, axis=2)
    return dq, dk, jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * bk, axis=2)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, num_k, k_block, init)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- cudnn ---------------------------------------------------------------------------------------

def _cudnn(q, k, v, token_mask, segment_ids, implementation: str = "cudnn", scale=None, prefix_ids=None):
  """cuDNN flash attention through `jax.nn.dot_product_attention`.

  cuDNN's padding is per-row lengths (padding on the right only), so each row's real tokens are
  first moved to its front in order (a stable [B, T] permutation: causal order among them is
  kept), run with `query_seq_lengths` / `key_value_seq_lengths`, and moved back. The public API
  has no segment ids: packed rows go through its `mask` argument, a [B, 1, T, T] bool that cuDNN
  turns into a bias (T^2 memory; `auto` picks chunked for packed rows instead).
  `implementation="xla"` runs the same wrapping on any backend (tests).
  """
  if implementation == "cudnn":
    if target_platform() != "gpu":
      raise ConfigError(f"config.model.attention='cudnn' needs a GPU, but the program is compiled for "
                        f"{target_platform()!r}; use 'chunked' or 'auto'.")
    if jnp.dtype(q.dtype) not in (jnp.bfloat16, jnp.float16):
      raise ConfigError(f"config.model.attention='cudnn' needs model.dtype bfloat16 or float16 (cuDNN flash "
                        f"attention), got {jnp.dtype(q.dtype).name}; use 'chunked' or 'auto'.")
  b, t, kh, r, dh = q.shape
  order = jnp.argsort(~token_mask, axis=1, stable=True)  # [B, T]: real tokens first, in order
  inverse = jnp.argsort(order, axis=1)
  lengths = token_mask.sum(axis=1).astype(jnp.int32)  # [B]
  take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
  mask = None
  if segment_ids is not None:
    seg = jnp.take_along_axis(segment_ids, order, axis=1)
    pre = None if prefix_ids is None else jnp.take_along_axis(prefix_ids, order, axis=1)
    mask = _segment_mask(seg, seg, pre)[:, None]  # [B, 1, T, T]
  out = jax.nn.dot_product_attention(
      take(q, order).reshape(b, t, kh * r, dh), take(k, order), take(v, order), mask=mask, is_causal=True,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation, scale=scale)
  return _valid_rows(take(out.reshape(b, t, kh, r, dh), inverse), token_mask)


# ---- splash (Pallas TPU) ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _splash_kernel(length: int, heads: int, block: int, interpret: bool):
  """A causal splash-attention kernel for [H, T, Dh] queries and [K, T, Dh] keys (GQA built in)."""
  # Function-local: the Pallas TPU kernels are imported only by the runs that use them (start-up time).
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  mask = sa.MultiHeadMask([sa.CausalMask((length, length))] * heads)
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  with jax.ensure_compile_time_eval():  # the mask tables are constants, also when first built under a trace
    return sa.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def _splash(q, k, v, token_mask, segment_ids, block, interpret, scale=None):
  """Splash attention: causal block sparsity from a static mask, padding and packing from segment ids.

  Padding tokens get their own segment (`_PAD_SEGMENT`), so every row sees at least itself, as
  the kernel requires; their outputs are then zeroed. T is padded to a multiple of the block
  (a multiple of 128). The kernel has no batch axis: it is vmapped over B, and inside a mesh
  context it runs under `shard_map` with the batch and KV heads sharded as the logical-axis rules
  say. Scores are scaled by folding `scale` (default 1 / sqrt(Dh)) into q.
  """
  if interpret is None:
    if target_platform() != "tpu":
      raise ConfigError(f"config.model.attention='splash' needs a TPU, but the program is compiled for "
                        f"{target_platform()!r}; use 'chunked' or 'auto'.")
    interpret = False
  b, t, kh, r, dh = q.shape
  blk = min(_round_up(block, 128), _round_up(t, 128))
  tp = _round_up(t, blk)
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = _pad_axis(jnp.where(token_mask, seg, _PAD_SEGMENT), tp, 1, _PAD_SEGMENT)  # [B, Tp]
  qh = scale_scores(q.astype(jnp.float32), scale, dh).astype(q.dtype)
  qh = _pad_axis(qh.reshape(b, t, kh * r, dh).transpose(0, 2, 1, 3), tp, 2)  # [B, H, Tp, Dh]
  kt = _pad_axis(k.transpose(0, 2, 1, 3), tp, 2)  # [B, K, Tp, Dh]
  vt = _pad_axis(v.transpose(0, 2, 1, 3), tp, 2)

  def run(qh, kt, vt, seg):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa  # as in _splash_kernel
    kernel = _splash_kernel(tp, qh.shape[1], blk, interpret)
    one = lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=sa.SegmentIds(s1, s1))
    return jax.vmap(one)(qh, kt, vt, seg)

  mesh = _context_mesh()
  if mesh is not None and mesh.size > 1:  # Mosaic kernels are not partitioned automatically
    run = _shard_batch_and_heads(run, mesh, b, kh)
  out = run(qh, kt, vt, seg)[:, :, :t]  # [B, H, T, Dh]
  return _valid_rows(out.transpose(0, 2, 1, 3).reshape(b, t, kh, r, dh), token_mask)


def target_platform() -> str:
  """The platform the traced program is for: its mesh's devices where a concrete mesh is in context
  (a deviceless TPU topology compiled from a CPU process is 'tpu'), else JAX's default backend."""
  mesh = _context_mesh()
  devices = getattr(mesh, "devices", None)
  if devices is not None and devices.size:
    return devices.flat[0].platform
  return jax.default_backend()


def _context_mesh():
  """The mesh programs are traced under: rljax's `sharding.activate`, else `jax.sharding.set_mesh`."""
  mesh = shd.active_mesh()
  if mesh is None:
    abstract = jax.sharding.get_abstract_mesh()
    mesh = None if abstract.empty else abstract
  return mesh


def _shard_batch_and_heads(fn, mesh, batch: int, kv_heads: int):
  """`fn(q [B, H, T, Dh], k [B, K, T, Dh], v, seg [B, T])` under shard_map, B and K sharded as the
  default logical-axis rules say (batch over data and fsdp, KV heads over tensor) where they divide."""
  bs = hs = None  # a mesh with other axis names: replicated (each device runs the whole kernel)
  if set(shd.MESH_AXES) <= set(mesh.axis_names):
    bs, hs = shd.logical_to_spec(("batch", "kv_heads"), (batch, kv_heads), mesh)
  heads = jax.sharding.PartitionSpec(bs, hs, None, None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, jax.sharding.PartitionSpec(bs, None)),
                       out_specs=heads, check_vma=False)
