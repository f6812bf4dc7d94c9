"""The in-graph sampler: parity with transformers, exact log-probs, truncation statistics, sharding, errors."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import left_padded_prompts

from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.models.convert import hf_to_params
from rljax.models.policy import Policy, apply_model, output_kernel
from rljax.models.transformer import positions_from_mask
from rljax.rl.logprobs import chunked_logprobs
from rljax.rollout import SampleOutput, SamplingParams, draw, generate, sample, sample_logits, sampler

VOCAB = 96
LENGTHS = (7, 3, 5, 1)  # ragged prompts, left-padded to width 7


def _hf_model(family: str, seed: int = 0):
  """A tiny transformers model with every weight random (biases and norms included)."""
  import torch
  import transformers
  common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, eos_token_id=None,
                bos_token_id=None, pad_token_id=0)
  if family == "llama":
    cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
    cls = transformers.LlamaForCausalLM
  elif family == "qwen2":
    cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    cls = transformers.Qwen2ForCausalLM
  else:
    cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    cls = transformers.Qwen3ForCausalLM
  torch.manual_seed(seed)
  model = cls(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  model.generation_config.eos_token_id = None
  return model


def _rljax_from_hf(model):
  config = ModelConfig.from_hf(model.config.to_dict())
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  return config, hf_to_params(config, sd.__getitem__, set(sd))


def _ragged(lengths=LENGTHS, seed=0):
  return left_padded_prompts(lengths, VOCAB, low=1, seed=seed)


@pytest.fixture(scope="module")
def models():
  out = {}
  for family in ("llama", "qwen2", "qwen3"):
    hf = _hf_model(family)
    out[family] = (hf, *_rljax_from_hf(hf))
  return out


def _hf_greedy(model, ids, mask, new_tokens, eos=None):
  import torch
  with torch.no_grad():
    out = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                         do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=0)
  gen = out[:, ids.shape[1]:].numpy()
  return np.pad(gen, ((0, 0), (0, new_tokens - gen.shape[1])))  # HF stops once every row is done


def _pick_eos(ref):
  """A token that ends some rows in the middle and is absent from others."""
  for tok in np.unique(ref[:, 1:-2]):
    hits = [(row == tok).any() and np.argmax(row == tok) >= 1 for row in ref]
    if any(hits) and not all((row == tok).any() for row in ref):
      return int(tok)
  raise AssertionError("no suitable EOS token in the reference generations")


# ---- greedy parity with transformers ---------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(family, models):
  hf, config, params = models[family]
  ids, mask = _ragged()
  t_new = 10
  eos = _pick_eos(_hf_greedy(hf, ids, mask, t_new))
  ref = _hf_greedy(hf, ids, mask, t_new, eos=eos)

  sp = SamplingParams(num_samples=2, max_new_tokens=t_new, greedy=True)
  out = jax.jit(sample, static_argnums=(0, 4, 6))(config, params, ids, mask, sp, jax.random.key(0), (eos,))
  tokens = np.asarray(out.grouped().tokens)
  for g in range(2):
    np.testing.assert_array_equal(tokens[:, g], ref)

  # Rows that emitted EOS stop there (EOS included); the others are truncated at t_new.
  stopped = (ref == eos).any(1)
  assert stopped.any() and not stopped.all()
  want_len = np.where(stopped, np.argmax(ref == eos, axis=1) + 1, t_new)
  np.testing.assert_array_equal(np.asarray(out.lengths).reshape(-1, 2), np.repeat(want_len[:, None], 2, 1))
  np.testing.assert_array_equal(np.asarray(out.truncated).reshape(-1, 2), np.repeat(~stopped[:, None], 2, 1))
  m = np.asarray(out.mask)
  np.testing.assert_array_equal(m, np.arange(t_new)[None] < np.asarray(out.lengths)[:, None])
  assert (np.asarray(out.tokens)[~m] == 0).all()  # pad id after the stop
  assert (np.asarray(out.logprobs)[~m] == 0).all() and (np.asarray(out.logprobs)[m] <= 0).all()
  np.testing.assert_array_equal(np.asarray(out.prompt_ids), np.repeat(ids, 2, axis=0))
  np.testing.assert_array_equal(np.asarray(out.prompt_mask), np.repeat(mask, 2, axis=0))


def test_right_padding_matches_left_padding(models):
  _, config, params = models["llama"]
  ids, mask = _ragged()
  right_ids, right_mask = np.zeros_like(ids), np.zeros_like(mask)
  for i, n in enumerate(LENGTHS):
    right_ids[i, :n], right_mask[i, :n] = ids[i, -n:], True
  sp = SamplingParams(num_samples=3, max_new_tokens=6, temperature=0.9)
  f = jax.jit(sample, static_argnums=(0, 4, 6))
  left = f(config, params, ids, mask, sp, jax.random.key(3), ())
  right = f(config, params, right_ids, right_mask, sp, jax.random.key(3), ())
  np.testing.assert_array_equal(np.asarray(left.tokens), np.asarray(right.tokens))
  np.testing.assert_allclose(np.asarray(left.logprobs), np.asarray(right.logprobs), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shared_prefix_prefill_samples_as_the_plain_prefill(models, family):
  """Prompts that begin with the same 5 tokens (a system prompt): the prefill that computes them
  once (`shared_prefix_layout` + `sample(shared_prefix=s)`) draws the same tokens as the plain one
  with the same key, its log-probs equal to 1e-5 (float32 reordering of the attention sums) and
  each row's log-probs equal the learner's on the layout it was given."""
  _, config, params = models[family]
  rng = np.random.default_rng(7)
  system = rng.integers(1, VOCAB, 5)
  tails = [rng.integers(1, VOCAB, n) for n in (4, 1, 6, 2)]       # ragged after the shared part
  width = 5 + 6 + 1
  ids, mask = np.zeros((4, width), np.int32), np.zeros((4, width), bool)
  for i, t in enumerate(tails):
    row = np.concatenate([system, t])
    ids[i, -len(row):], mask[i, -len(row):] = row, True
  shared_ids, shared_mask, s = sampler.shared_prefix_layout(ids, mask)
  assert s == 5 and shared_mask[:, :5].all() and (shared_ids[:, :5] == system).all()
  for i, t in enumerate(tails):   # each prompt's own tokens, left-padded after the shared ones
    np.testing.assert_array_equal(shared_ids[i][shared_mask[i]], np.concatenate([system, t]))
  f = jax.jit(sample, static_argnums=(0, 4, 6), static_argnames=("shared_prefix",))
  for sp in (SamplingParams(num_samples=3, max_new_tokens=6, temperature=0.9),
             SamplingParams(num_samples=1, max_new_tokens=6, greedy=True)):
    plain = f(config, params, ids, mask, sp, jax.random.key(3), ())
    shared = f(config, params, shared_ids, shared_mask, sp, jax.random.key(3), (), shared_prefix=s)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(shared.lengths), np.asarray(plain.lengths))
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(plain.logprobs), atol=1e-5)
    if not sp.greedy:
      want, _ = _learner_logprobs(config, params, shared, sp.logprob_temperature)
      m = np.asarray(shared.mask)
      assert m.sum() > 20
      assert np.abs(np.asarray(shared.logprobs) - np.asarray(want))[m].max() <= 1e-5


def test_shared_prefix_layout_needs_a_shared_prefix():
  ids = np.asarray([[0, 5, 6, 7], [0, 0, 5, 9], [8, 5, 6, 7]], np.int32)
  mask = ids > 0
  out_ids, out_mask, s = sampler.shared_prefix_layout(ids[:2], mask[:2])
  assert s == 1 and out_ids[:, 0].tolist() == [5, 5]          # [5 6 7] and [5 9] share "5"
  assert sampler.shared_prefix_layout(ids, mask)[2] == 0       # the third starts with 8
  assert sampler.shared_prefix_layout(ids[:2], mask[:2], min_shared=2)[2] == 0
  same = np.asarray([[3, 4], [3, 4]], np.int32)
  assert sampler.shared_prefix_layout(same, same > 0)[2] == 1  # the last token stays per prompt
  assert sampler.shared_prefix_layout(ids[:1], mask[:1])[2] == 0   # one prompt: nothing to share


# ---- log-probs equal the learner's ---------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 3))
def _learner_logprobs(config, params, out: SampleOutput, temperature):
  """Teacher-forced: the trainer's forward on prompt + completion, chunked log-softmax."""
  width = out.prompt_ids.shape[1]
  seq = jnp.concatenate([out.prompt_ids, out.tokens], axis=1)
  seq_mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
  hidden = apply_model(config, params, seq, positions_from_mask(seq_mask), seq_mask, return_hidden=True).hidden
  hidden = hidden[:, width - 1:width - 1 + out.tokens.shape[1]]
  return chunked_logprobs(hidden, output_kernel(config, params), out.tokens, temperature=temperature, chunk_size=40)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_logprobs_equal_learner(models, temperature, top_k, top_p):
  _, config, params = models["qwen3"]
  ids, mask = _ragged()
  sp = SamplingParams(num_samples=4, max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
  out = jax.jit(sample, static_argnums=(0, 4, 6))(config, params, ids, mask, sp, jax.random.key(1), (5,))
  lp, ent = _learner_logprobs(config, params, out, sp.logprob_temperature)
  m = np.asarray(out.mask)
  assert m.sum() > 40
  # The recorded log-prob is that of the un-truncated distribution, even when top-k/top-p cut.
  assert np.abs(np.asarray(out.logprobs) - np.asarray(lp))[m].max() <= 1e-5
  assert np.abs(np.asarray(out.entropy) - np.asarray(ent))[m].max() <= 1e-4


def test_greedy_logprobs_use_given_temperature(models):
  _, config, params = models["qwen3"]
  ids, mask = _ragged()
  f = jax.jit(sample, static_argnums=(0, 4, 6))
  at1 = f(config, params, ids, mask, SamplingParams(4, 12, temperature=0.0), jax.random.key(0), ())
  at05 = f(config, params, ids, mask, SamplingParams(4, 12, temperature=0.7, greedy=True), jax.random.key(9), ())
  np.testing.assert_array_equal(np.asarray(at1.tokens), np.asarray(at05.tokens))  # temperature ignored for choice
  lp1, _ = _learner_logprobs(config, params, at1, 1.0)
  lp05, _ = _learner_logprobs(config, params, at05, 0.7)
  m = np.asarray(at1.mask)
  assert np.abs(np.asarray(at1.logprobs) - np.asarray(lp1))[m].max() <= 1e-5
  assert np.abs(np.asarray(at05.logprobs) - np.asarray(lp05))[m].max() <= 1e-5


# ---- sampled frequencies match the truncated distribution -----------------------------------


def _reference_keep(scaled, top_k, top_p, min_p):
  """numpy reference of the kept set, transformers' order: top-k, top-p (renormalised), min-p."""
  keep = np.ones_like(scaled, bool)
  if top_k:
    keep &= scaled >= np.sort(scaled)[-top_k]
  if top_p < 1:
    s = np.where(keep, scaled, -np.inf)
    p = np.exp(s - s.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros_like(keep)
    kept[order[before < top_p]] = True
    keep &= kept
  if min_p:
    keep &= scaled >= scaled.max() + math.log(min_p)
  return keep


def _chi_square_pvalue(counts, probs):
  from scipy import stats
  n = counts.sum()
  expected = probs * n
  chi2 = ((counts - expected) ** 2 / expected).sum()
  return stats.chi2.sf(chi2, len(probs) - 1)


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (6, 1.0, 0.0), (0, 0.8, 0.0), (8, 0.9, 0.05),
                                                (0, 1.0, 0.15)])
def test_sampled_frequencies_match_truncated_distribution(top_k, top_p, min_p):
  # 40,000 draws from one row of 16 logits. Tolerance: a chi-square goodness-of-fit p-value above
  # 1e-3 (seed fixed, so the test is deterministic) and no draw outside the kept set.
  logits = jnp.asarray(np.random.default_rng(0).normal(0, 1.5, 16), jnp.float32)
  sp = SamplingParams(1, 1, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
  n = 40_000
  tokens, lp, ent = jax.jit(sample_logits, static_argnums=1)(jnp.tile(logits, (n, 1)), sp, jax.random.key(42))
  scaled = np.asarray(logits, np.float64) / 0.8
  keep = _reference_keep(scaled, top_k, top_p, min_p)
  assert keep.sum() >= 3
  probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
  probs /= probs.sum()
  counts = np.bincount(np.asarray(tokens), minlength=16)
  assert counts[~keep].sum() == 0
  assert _chi_square_pvalue(counts[keep], probs[keep]) > 1e-3
  full = scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
  np.testing.assert_allclose(np.asarray(lp), full[np.asarray(tokens)], atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), -(np.exp(full) * full).sum(), atol=1e-5)


@pytest.mark.parametrize("top_k", [0, 40])
def test_two_level_draw_matches_the_distribution(top_k):
  """Vocabularies wider than two draw blocks take the block-then-token path: 1,300 logits (not a
  multiple of the block), mass spread over many blocks. 40,000 draws; the counts of the 30 most
  likely tokens and of the rest pooled fit the distribution (chi-square p > 1e-3, seed fixed)."""
  v = 1300
  assert v > 2 * draw._DRAW_BLOCK and v % draw._DRAW_BLOCK
  logits = jnp.asarray(np.random.default_rng(3).normal(0, 2.0, v), jnp.float32)
  sp = SamplingParams(1, 1, top_k=top_k)
  n = 40_000
  tokens, _, _ = jax.jit(sample_logits, static_argnums=1)(jnp.tile(logits, (n, 1)), sp, jax.random.key(5))
  scaled = np.asarray(logits, np.float64)
  keep = _reference_keep(scaled, top_k, 1.0, 0.0)
  probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
  probs /= probs.sum()
  counts = np.bincount(np.asarray(tokens), minlength=v)
  assert counts[~keep].sum() == 0
  top = np.argsort(-probs)[:30]
  rest = np.setdiff1d(np.flatnonzero(keep), top)
  assert probs[rest].sum() > 0.05 or top_k, "the pooled tail must carry mass to test the block draw"
  cells_c = np.append(counts[top], counts[rest].sum())
  cells_p = np.append(probs[top], probs[rest].sum())
  if top_k:   # every kept token is among the top 40: no pooled cell
    cells_c, cells_p = counts[np.flatnonzero(keep)], probs[np.flatnonzero(keep)]
  assert _chi_square_pvalue(cells_c, cells_p) > 1e-3
  assert len(np.unique(np.asarray(tokens) // draw._DRAW_BLOCK)) > 3     # draws land in many blocks


def test_sampler_frequencies_end_to_end(models):
  """The whole sampler (prefill, fan-out) draws the first token from the top-p distribution."""
  _, config, params = models["qwen2"]
  ids, mask = _ragged(lengths=(4,))
  sp = SamplingParams(num_samples=4000, max_new_tokens=1, temperature=1.3, top_p=0.7)
  out = jax.jit(sample, static_argnums=(0, 4, 6))(config, params, ids, mask, sp, jax.random.key(7), ())
  logits = np.asarray(apply_model(config, params, ids, positions_from_mask(mask), mask).logits[0, -1], np.float64)
  scaled = logits / 1.3
  keep = _reference_keep(scaled, 0, 0.7, 0.0)
  probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
  probs /= probs.sum()
  counts = np.bincount(np.asarray(out.tokens)[:, 0], minlength=VOCAB)
  assert counts[~keep].sum() == 0 and keep.sum() >= 3
  assert _chi_square_pvalue(counts[keep], probs[keep]) > 1e-3


def test_top_p_wide_nucleus_uses_exact_fallback():
  # Flat logits over 1024 tokens: the nucleus is wider than the 256 candidates, so the bisection
  # decides it; the kept set must equal the sorted-cumsum reference exactly.
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 0.3, (6, 1024)).astype(np.float32)
  logits[0] = rng.normal(0, 4.0, 1024)  # one peaked row, decided by the candidates
  sp = SamplingParams(1, 1, top_p=0.9)
  scaled = jnp.asarray(logits)
  shifted = scaled - scaled.max(-1, keepdims=True)
  log_z = jnp.log(jnp.exp(shifted).sum(-1))
  thr = np.asarray(jax.jit(draw._truncation_threshold, static_argnums=3)(scaled, shifted, log_z, sp))
  for row, t in zip(logits, thr):
    np.testing.assert_array_equal(row >= t, _reference_keep(row.astype(np.float64), 0, 0.9, 0.0))


def test_greedy_and_k1_agree():
  logits = jax.random.normal(jax.random.key(0), (32, 50))
  f = jax.jit(sample_logits, static_argnums=1)
  g, _, _ = f(logits, SamplingParams(1, 1, greedy=True), jax.random.key(0))
  k1, _, _ = f(logits, SamplingParams(1, 1, top_k=1), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(g), np.argmax(np.asarray(logits), -1))
  np.testing.assert_array_equal(np.asarray(k1), np.asarray(g))


@pytest.mark.parametrize("kw", [{"top_p": 0.9}, {"top_k": 50}, {"top_k": 50, "top_p": 0.9}])
def test_truncated_draw_compiles_a_top_k_not_a_sort_of_the_vocabulary(kw):
  # XLA:CPU rewrote the candidates' top-k into a sort of every row (0.98 s instead of 0.12 s per
  # draw of 128 x 49152 at top_p=0.9); `_Vocab.top_k` keeps the TopK call behind a barrier.
  sp = SamplingParams(1, 1, **kw)
  hlo = jax.jit(lambda x: sample_logits(x, sp, jax.random.key(0))).lower(jnp.zeros((8, 4096))).compile().as_text()
  assert "TopK" in hlo or jax.default_backend() != "cpu"
  assert " sort(" not in hlo


def test_first_argmax_is_jnp_argmax_with_ties_and_a_ragged_last_block():
  # The two-level argmax of the greedy draw must pick exactly jnp.argmax's index: the first of
  # tied maxima (within a block and across blocks), 0 for a row of -inf.
  v = 1000   # 3 blocks of 256 and a ragged fourth
  rng = np.random.default_rng(0)
  x = rng.normal(0, 1, (7, v)).astype(np.float32)
  x[1, [5, 700]] = 9.0                # tie across blocks: the first
  x[2, [300, 301]] = 9.0              # tie inside a block
  x[3, 999] = 9.0                     # the max in the padded last block
  x[4, [10, 600]] = [50.0, 50.0]     # a tie in the first block and a later one
  x[5] = -np.inf
  x[6, 256] = 9.0                     # the first column of a block
  got = np.asarray(jax.jit(draw.first_argmax)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), -1)))
  np.testing.assert_array_equal(got[1:4], [5, 300, 999])
  assert got.dtype == np.int32
  small = rng.normal(0, 1, (3, 40)).astype(np.float32)    # one level below two blocks
  np.testing.assert_array_equal(np.asarray(draw.first_argmax(jnp.asarray(small))), small.argmax(-1))


@pytest.mark.parametrize("t", [1, 3])
def test_shared_prefix_attention_equals_fanned_out_cache(t):
  """Attention of T new tokens per row over a prompt cache shared by each group of G rows equals
  attention over one cache per row holding the prompt's slots followed by the row's own (the
  layout before sharing), with masked slots in both parts (left padding, rows at different
  lengths, causal among the T new tokens). Tolerance 1e-6 (float32, another summation order)."""
  from rljax.models.cache import LayerCache, PrefixView, cached_attention
  p, g, kh, r, dh, sp, s = 3, 4, 2, 3, 16, 7, 6
  keys = jax.random.split(jax.random.key(t), 5)
  q = jax.random.normal(keys[0], (p * g, t, kh, r, dh))
  pk, pv = jax.random.normal(keys[1], (p, kh, dh, sp)), jax.random.normal(keys[2], (p, kh, sp, dh))
  k, v = jax.random.normal(keys[3], (p * g, kh, dh, s)), jax.random.normal(keys[4], (p * g, kh, s, dh))
  pmask = jnp.arange(sp)[None, :] >= jnp.array([[0], [2], [4]])                  # left padding of 0, 2, 4
  lengths = jnp.arange(p * g) % (s - t + 1)                                        # rows at different lengths
  mask = jnp.arange(s)[None, None, :] <= (lengths[:, None] + jnp.arange(t)[None, :])[..., None]  # [B, T, S]
  shared = cached_attention(q, LayerCache(k, v), mask, PrefixView(LayerCache(pk, pv), pmask))
  fan = lambda x: jnp.repeat(x, g, axis=0)
  full_mask = jnp.concatenate([jnp.broadcast_to(fan(pmask)[:, None], (p * g, t, sp)), mask], -1)
  full = cached_attention(q, LayerCache(jnp.concatenate([fan(pk), k], -1), jnp.concatenate([fan(pv), v], -2)),
                          full_mask)
  assert shared.shape == (p * g, t, kh, r, dh)
  np.testing.assert_allclose(np.asarray(shared), np.asarray(full), atol=1e-6, rtol=1e-6)
  # The prefix matters: dropping it changes the output.
  assert np.abs(np.asarray(cached_attention(q, LayerCache(k, v), mask)) - np.asarray(full)).max() > 1e-2


# ---- reproducibility, stop tokens, sharding ---------------------------------------------------


def test_fixed_key_reproducible_and_stop_tokens(models):
  _, config, params = models["llama"]
  ids, mask = _ragged()
  sp = SamplingParams(num_samples=4, max_new_tokens=8, temperature=1.0, stop_token_ids=(3, 4, 5, 6, 7, 8))
  f = jax.jit(sample, static_argnums=(0, 4, 6))
  a = f(config, params, ids, mask, sp, jax.random.key(5), (9,))
  b = f(config, params, ids, mask, sp, jax.random.key(5), (9,))
  c = f(config, params, ids, mask, sp, jax.random.key(6), (9,))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
  tokens, m, lengths = np.asarray(a.tokens), np.asarray(a.mask), np.asarray(a.lengths)
  for row, n, trunc in zip(tokens, lengths, np.asarray(a.truncated)):
    stops = np.isin(row[:n], (3, 4, 5, 6, 7, 8, 9))
    assert not stops[:-1].any()  # nothing before the end stops
    assert trunc == (not stops[-1])
    assert n == 8 or stops[-1]
  np.testing.assert_array_equal(lengths, m.sum(1))


def test_sharded_matches_single_device(models):
  from rljax import sharding as shd
  from rljax.models.policy import param_shardings
  if jax.device_count() < 8:
    pytest.skip("needs 8 (simulated) devices")
  _, config, params = models["llama"]
  ids, mask = _ragged()
  sp = SamplingParams(num_samples=4, max_new_tokens=8, temperature=1.0, top_p=0.95)
  key = jax.random.key(11)
  single = jax.jit(sample, static_argnums=(0, 4, 6))(config, params, ids, mask, sp, key, (3,))

  mesh = shd.make_mesh((2, 2, 2))
  sharded_params = jax.device_put(params, param_shardings(config, mesh))
  ids_s = jax.device_put(ids, shd.batch_sharding(mesh, 2, ids.shape[0]))
  mask_s = jax.device_put(mask, shd.batch_sharding(mesh, 2, ids.shape[0]))
  f = jax.jit(sample, static_argnums=(0, 4, 6), static_argnames=("mesh",))
  out = f(config, sharded_params, ids_s, mask_s, sp, key, (3,), mesh=mesh)
  assert out.tokens.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
  np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(single.mask))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(single.logprobs), atol=1e-5)


# ---- the generate entry point and bad input ---------------------------------------------------


def test_generate_ragged_lists_and_grouped_views(models):
  _, config, params = models["qwen2"]
  policy = Policy(config=config.replace(eos_token_ids=(2,)), params=params)
  prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
  sp = SamplingParams(num_samples=2, max_new_tokens=5)
  out = generate(policy, prompts, sp, 0)
  grouped = out.grouped()
  assert out.tokens.shape == (6, 5) and grouped.tokens.shape == (3, 2, 5) and grouped.lengths.shape == (3, 2)
  assert out.num_prompts == 3 and out.prompt_ids.shape[1] % 16 == 0  # widths bucketed
  np.testing.assert_array_equal(np.asarray(grouped.tokens[1, 0]), np.asarray(out.tokens[2]))
  # Same prompts as an explicit left-padded array give the same completions.
  ids, mask = np.zeros((3, 5), np.int32), np.zeros((3, 5), bool)
  for i, p in enumerate(prompts):
    ids[i, 5 - len(p):], mask[i, 5 - len(p):] = p, True
  again = generate(policy, ids, sp, jax.random.key(0), prompt_mask=mask)
  np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))


def test_left_pad_stage_ends_and_effective_temperature():
  from rljax.padding import left_pad
  ids, mask = left_pad([[5, 6, 7], [], [8]], pad_id=1, multiple=4)
  np.testing.assert_array_equal(ids, [[1, 5, 6, 7], [1, 1, 1, 1], [1, 1, 1, 8]])
  np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]])
  assert ids.dtype == np.int32 and mask.dtype == bool
  ids, mask = left_pad([np.array([2, 3])], None, width=5, dtype=np.int64)
  assert ids.tolist() == [[0, 0, 0, 2, 3]] and ids.dtype == np.int64 and mask.sum() == 2
  with pytest.raises(ValueError, match="width 1"):
    left_pad([[1, 2]], 0, width=1)
  # The completion cache grows in up to 4 stages of at least 32 tokens.
  assert sampler.stage_ends(128) == (32, 64, 96, 128) and sampler.stage_ends(70) == (35, 70)
  assert sampler.stage_ends(40) == (40,)
  # Temperature 0 means greedy, its log-probs recorded at temperature 1.
  assert draw.effective_temperature(0) == 1.0 and draw.effective_temperature(0.7) == 0.7
  assert SamplingParams(1, 1, temperature=0.0).logprob_temperature == 1.0


@pytest.mark.parametrize("field,kwargs", [
    ("num_samples", dict(num_samples=0)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("temperature", dict(temperature=-0.5)),
    ("top_k", dict(top_k=-1)),
    ("top_p", dict(top_p=0.0)),
    ("min_p", dict(min_p=1.0)),
    ("stop_token_ids", dict(stop_token_ids=(-3,))),
    ("num_samples", dict(num_samples=2.5)),
])
def test_bad_sampling_params(field, kwargs):
  base = dict(num_samples=2, max_new_tokens=4)
  with pytest.raises(ConfigError, match=f"SamplingParams.{field}"):
    SamplingParams(**{**base, **kwargs})


def test_bad_prompts(models):
  _, config, params = models["llama"]
  policy = Policy(config=config, params=params)
  sp = SamplingParams(num_samples=2, max_new_tokens=4)
  with pytest.raises(ConfigError, match="prompt 1 is empty"):
    generate(policy, np.ones((2, 3), np.int32), sp, 0, prompt_mask=np.array([[1, 1, 1], [0, 0, 0]], bool))
  with pytest.raises(ConfigError, match="longer than the model's context"):
    generate(policy, [list(range(1, 70))], sp, 0)
  with pytest.raises(ConfigError, match="max_new_tokens=40 exceeds"):
    generate(policy, [list(range(1, 30))], SamplingParams(1, 40), 0)
  with pytest.raises(ConfigError, match="outside the vocabulary"):
    generate(policy, [[1, VOCAB + 3]], sp, 0)
  with pytest.raises(ConfigError, match="width 0"):
    sample(config, params, jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 0), bool), sp, jax.random.key(0))
  with pytest.raises(ConfigError, match="longer than the model's context"):
    sample(config, params, jnp.ones((1, 65), jnp.int32), jnp.ones((1, 65), bool), sp, jax.random.key(0))


def test_empty_prompt_row_inside_jit_yields_empty_completion(models):
  _, config, params = models["llama"]
  ids, mask = _ragged()
  mask[2] = False
  out = jax.jit(sample, static_argnums=(0, 4, 6))(config, params, ids, mask, SamplingParams(2, 4), jax.random.key(0))
  lengths = np.asarray(out.lengths).reshape(-1, 2)
  assert (lengths[2] == 0).all() and (lengths[[0, 1, 3]] > 0).all()
  assert not np.asarray(out.truncated).reshape(-1, 2)[2].any()
