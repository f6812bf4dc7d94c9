"""Device check parts: attention backends against the xla reference, and sampler vs learner log-probs."""
from __future__ import annotations

import numpy as np
from checklib import (
  CUDA_ONLY,
  Context,
  Recorder,
  build_workload,
  load_run_config,
  median,
  random_prompts,
  replicated_key,
  timed,
)


def _qkv(shape, seed=0):
  """q [B, T, K, R, Dh], k, v [B, T, K, Dh], a weight like q, token_mask [B, T] (row 1 left-padded,
  row 2 right-padded when B > 2), segment ids [B, T] (two segments per row), all float32."""
  import jax
  import jax.numpy as jnp
  b, t, kh, r, dh = shape
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, kh, r, dh))
  k = jax.random.normal(ks[1], (b, t, kh, dh))
  v = jax.random.normal(ks[2], (b, t, kh, dh))
  w = jax.random.normal(ks[3], (b, t, kh, r, dh))
  mask = np.ones((b, t), bool)
  mask[1 % b, :t // 8] = False
  if b > 2:
    mask[2, -t // 5:] = False
  seg = np.zeros((b, t), np.int32)
  seg[:, t // 3:] = 1
  return q, k, v, w, jnp.asarray(mask), jnp.asarray(seg)


def _value_and_grads(fn, dtype, q, k, v, w):
  """jit(fn)'s output and d/d(q, k, v) of sum(out * w), inputs cast to `dtype`, results float32."""
  import jax
  import jax.numpy as jnp

  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * w), out

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  cast = [x.astype(dtype) for x in (q, k, v)]
  (_, out), grads = f(*cast)
  return [np.asarray(x, np.float32) for x in (out, *grads)], lambda: jax.block_until_ready(f(*cast))


def _rel_err(got, want) -> float:
  """max |got - want| / max |want| over the output and the three gradients (the worst of the four)."""
  return max(float(np.max(np.abs(g - x)) / max(np.max(np.abs(x)), 1e-30)) for g, x in zip(got, want))


def attention(rec: Recorder, ctx: Context) -> None:
  """Each backend's output and gradients against the xla path in float32 at the highest matmul
  precision (the truth): in bfloat16 a backend passes when its error is at most twice xla's own
  bfloat16 error (or 1e-2); chunked in float32 must match to 1e-4. Also times forward + backward."""
  import jax
  import jax.numpy as jnp

  from rljax.models import attention as attn
  shape = (2, 64, 2, 2, 16) if ctx.cpu else tuple(ctx.options.get("attention_shape", (4, 2048, 2, 7, 64)))
  q, k, v, w, mask, seg = _qkv(shape)
  shape_note = "B, T, K, R, Dh = " + ", ".join(map(str, shape))
  picked = attn.resolve("auto", shape[1], jnp.bfloat16)
  want = "cudnn" if not ctx.cpu else ("chunked" if shape[1] > attn.AUTO_CHUNKED_MIN_TOKENS else "xla")
  rec.row("auto backend in bf16", "ok" if picked == want else "fail", {"picked": picked, "expected": want},
          f"{jax.default_backend()}, T={shape[1]}")

  for packed in (False, True):
    s = seg if packed else None
    label = "packed rows (segment ids)" if packed else "padded rows"
    impls = {"xla": lambda q, k, v, s=s: attn.attend(q, k, v, token_mask=mask, segment_ids=s, impl="xla"),
             "chunked": lambda q, k, v, s=s: attn.attend(q, k, v, token_mask=mask, segment_ids=s, impl="chunked",
                                                         block_q=512, block_k=512)}
    if ctx.cpu:   # cuDNN's own wrapping (row compaction, lengths, segment mask) through jax's xla implementation
      impls["cudnn wrapping (xla impl)"] = lambda q, k, v, s=s: attn._cudnn(q, k, v, mask, s, implementation="xla")
    else:
      impls["cudnn"] = lambda q, k, v, s=s: attn.attend(q, k, v, token_mask=mask, segment_ids=s, impl="cudnn")
    with jax.default_matmul_precision("highest"):
      truth, _ = _value_and_grads(impls["xla"], jnp.float32, q, k, v, w)
      got32, _ = _value_and_grads(impls["chunked"], jnp.float32, q, k, v, w)
    err = _rel_err(got32, truth)
    rec.row(f"chunked vs xla, fp32, {label}", "ok" if err < 1e-4 else "fail", {"rel_err": err},
            f"{shape_note}; threshold 1e-4")
    xla16, run_xla16 = _value_and_grads(impls["xla"], jnp.bfloat16, q, k, v, w)
    base = _rel_err(xla16, truth)
    for name, fn in impls.items():
      if name == "xla":
        continue

      def check(name=name, fn=fn, label=label, truth=truth, base=base):
        got, run = _value_and_grads(fn, jnp.bfloat16, q, k, v, w)
        err = _rel_err(got, truth)
        bound = max(2 * base, 1e-2)
        first, times, _ = timed(run, 3)
        rec.row(f"{name} vs xla, bf16, {label}", "ok" if err <= bound else "fail",
                {"rel_err": err, "xla_bf16_rel_err": base, "fwd_bwd_ms": 1e3 * median(times)},
                f"{shape_note}; error against fp32 xla, bound max(2 x xla's, 1e-2)")
      rec.guarded(f"{name} vs xla, bf16, {label}", check)
    _, times, _ = timed(run_xla16, 3)
    rec.row(f"xla, bf16, {label}: time", "ok", {"fwd_bwd_ms": 1e3 * median(times)}, shape_note)
  if ctx.cpu:
    rec.row("cudnn vs xla (cuDNN kernels)", "skipped", note=CUDA_ONLY)


def _gap_overrides(ctx: Context, dtype: str) -> dict:
  """A random model whose sampler and learner are compared: tiny on CPU, a 4-layer 512-wide one on GPU."""
  size = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=16) if ctx.cpu else dict(vocab_size=32768, hidden_size=512, intermediate_size=1408,
                                                 num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)
  out = {"model.path": "random", **{f"model.random.{k}": v for k, v in size.items()}}
  out.update({"model.dtype": dtype, "model.remat": False, "rl.kl_coef": 0.0, "train.prompts_per_step": 4,
              "sampling.num_samples": 4, "data.max_prompt_tokens": 16 if ctx.cpu else 64,
              "sampling.max_new_tokens": 16 if ctx.cpu else 128, "sampling.ignore_eos": True,
              "sampling.temperature": 1.0, "mesh.shape": (1, -1, 1)})
  return out


def logprobs(rec: Recorder, ctx: Context) -> None:
  """The sampler's log-probs of its own tokens (cached decode) against the learner's teacher-forced
  recompute (`rljax.trainer.step.sequence_logprobs`), on the same random weights (matrices x4, for
  logits less flat than at initialisation; the row reports the sampler's mean entropy), in fp32
  (jax's default matmul precision, which is free to use TF32 on NVIDIA GPUs), fp32 at the highest
  precision, and bf16. fp32-highest must agree to 1e-4 (mean |diff|); the others are measured, not
  judged (the bf16 gap is what rljax's truncated IS corrects)."""
  import contextlib

  import jax

  from rljax import sharding as shd
  from rljax.trainer.step import sequence_logprobs

  cases = [("fp32", "float32", None), ("fp32, matmul precision highest", "float32", "highest"),
           ("bf16", "bfloat16", None)]
  from rljax.models.policy import init_params
  from rljax.trainer.setup import read_model_config
  mc, _, _ = read_model_config(load_run_config(_gap_overrides(ctx, "float32")))
  params = jax.device_get(jax.jit(lambda k: init_params(mc, k))(jax.random.key(0)))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
  for label, dtype, precision in cases:
    if ctx.cpu and dtype == "float32" and precision is None:
      rec.row(f"sampler vs learner log-probs, {label}", "skipped",
              note="on the CPU jax's default fp32 matmul precision is full fp32: the next row is this one")
      continue

    def check(label=label, dtype=dtype, precision=precision):
      scope = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
      with scope:
        w = build_workload(load_run_config(_gap_overrides(ctx, dtype)), params=params)
        ids, mask = random_prompts(w, left_pad=True)
        rollout = w.generate(w.state.model_params(), replicated_key(w, 1), ids, mask)

        def learner(params, r):
          with shd.activate(w.mesh):
            return sequence_logprobs(w.run.spec, params, r.prompt_ids, r.prompt_mask, r.tokens, r.context_mask)[0]

        lp = jax.jit(learner)(w.state.model_params(), rollout)
        m = np.asarray(rollout.mask)
        diff = np.abs(np.asarray(lp) - np.asarray(rollout.logprobs))[m]
        ent = float(np.asarray(rollout.entropy)[m].mean())
      values = {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
                "frac_ratio_off_1pct": float((diff > np.log(1.01)).mean()), "sampler_entropy": ent,
                "tokens": int(m.sum())}
      judged = precision == "highest" or (ctx.cpu and dtype == "float32")
      ok = np.isfinite(diff).all() and (not judged or values["mean_abs_diff"] < 1e-4)
      note = "threshold: mean 1e-4" if judged else "measured (no threshold)"
      rec.row(f"sampler vs learner log-probs, {label}", "ok" if ok else "fail", values, note)

    rec.guarded(f"sampler vs learner log-probs, {label}", check)
