"""The packed update (rljax/trainer/packing.py) computes what the padded update computes."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rljax.models.config import ModelConfig
from rljax.models.policy import init_params
from rljax.rl import LossConfig
from rljax.rollout import Rollout, SamplingParams
from rljax.trainer import packing
from rljax.trainer.optim import make_optimizer
from rljax.trainer.state import TrainState
from rljax.trainer.step import StepSpec, make_update_fn

G, P, LP, T = 4, 4, 8, 16


def _rollout(seed=0):
  """Left-padded prompts of 2..8 tokens and completions of 1..16 tokens (some truncated)."""
  rng = np.random.default_rng(seed)
  n = P * G
  plen = np.repeat(rng.integers(2, LP + 1, P), G)
  clen = rng.integers(1, T + 1, n)
  prompt_mask = np.arange(LP)[None, :] >= (LP - plen)[:, None]
  mask = np.arange(T)[None, :] < clen[:, None]
  tokens = np.where(mask, rng.integers(1, 60, (n, T)), 0).astype(np.int32)
  prompt_ids = np.where(prompt_mask, np.repeat(rng.integers(1, 60, (P, LP)), G, axis=0), 0).astype(np.int32)
  lp = np.where(mask, -rng.uniform(0.1, 3.0, (n, T)), 0.0).astype(np.float32)
  return Rollout.single_turn(prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_mask),
                             tokens=jnp.asarray(tokens), mask=jnp.asarray(mask), logprobs=jnp.asarray(lp),
                             entropy=jnp.zeros((n, T), jnp.float32), lengths=jnp.asarray(clen, jnp.int32),
                             truncated=jnp.asarray(clen == T), group_size=G).with_rewards(
                                 rng.uniform(0, 1, n).astype(np.float32), np.zeros((n, 1), np.float32))


def _tiny_update_setup(ref_scale: float | None = None):
  """A tiny model (xla attention), G x T sampling, and one Adam state for the update-equality tests.
  Adam's eps is 1e-3 (see test_packed_update_equals_padded); ref_scale: a reference model of the
  parameters times it (KL), or none."""
  mc = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, attention="xla")
  sp = SamplingParams(num_samples=G, max_new_tokens=T, temperature=1.0)
  optim = ml_collections.ConfigDict(dict(learning_rate=1e-3, warmup_steps=0, min_lr_ratio=0.0, schedule="constant",
                                         max_grad_norm=None, b1=0.9, b2=0.999, eps=1e-3, weight_decay=0.0))
  optimizer, _ = make_optimizer(optim, 10)
  params = init_params(mc, jax.random.key(1))
  ref = None if ref_scale is None else jax.tree.map(lambda p: p * ref_scale, params)
  return mc, sp, optimizer, TrainState.create(params, optimizer, 0, ref_params=ref)


def test_pack_places_whole_sequences_with_their_positions():
  r = _rollout()
  layout = packing.pack(r.prompt_ids, r.prompt_mask, r.tokens, r.context_mask, bins_per_block=2)
  width = LP + T
  seg = np.asarray(layout.segment_ids).reshape(-1)
  tok = np.asarray(layout.tokens).reshape(-1)
  pos = np.asarray(layout.positions).reshape(-1)
  for i in range(P * G):
    plen, clen = int(r.prompt_mask[i].sum()), int(r.lengths[i])
    at = np.flatnonzero(seg == i + 1)
    assert len(at) == plen + clen and np.all(np.diff(at) == 1)        # contiguous, whole
    assert at[0] // width == at[-1] // width                          # never split across bins
    want = np.concatenate([np.asarray(r.prompt_ids[i])[LP - plen:], np.asarray(r.tokens[i])[:clen]])
    np.testing.assert_array_equal(tok[at], want)
    np.testing.assert_array_equal(pos[at], np.arange(plen + clen))
  used_bins = len(np.unique(np.flatnonzero(seg) // width))
  assert used_bins < P * G                                            # real tokens need fewer bins than rows
  assert int(layout.num_blocks) == -(-used_bins // 2)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "gspo"])
def test_packed_update_equals_padded(preset):
  """Loss, metrics and the updated parameters: packed vs padded rows. float32: the same sums in
  another order (blocks instead of rows), so relative 1e-5 on the figures. Parameters after one
  Adam step: Adam's first update is lr * g / (|g| + eps); with eps = 1e-3 its derivative in g is at
  most lr / eps = 1, so parameters differ by at most the gradients' reordering noise (~1e-9 here),
  asserted 1e-6. (With eps = 1e-8 an element whose gradient is ~1e-8 turns that noise into an
  update difference of up to lr: not a property of packing.)"""
  kw = {"kl_coef": 0.0} if preset == "grpo" else {}
  loss_cfg = LossConfig.from_preset(preset, entropy_coef=0.01, **kw)
  mc, sp, optimizer, state = _tiny_update_setup()
  rollout = _rollout(1)
  outs = []
  for pack_tokens in (0, 2 * (LP + T)):
    spec = StepSpec(model=mc, sampling=sp, loss=loss_cfg, prompts=P, pack_tokens=pack_tokens)
    outs.append(jax.jit(make_update_fn(spec, optimizer))(state, rollout))
  (s0, m0), (s1, m1) = outs
  assert m1["packed_tokens"] < m1["padded_tokens"]
  for key, value in m0.items():
    assert float(m1[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _next_fit_bins(lengths, width):
  """Bins the earlier rule used: rows in order, a new bin when a row does not fit the current one."""
  bins, room = 0, 0
  for n in lengths:
    if n > room:
      bins, room = bins + 1, width
    room -= n
  return bins


def test_first_fit_decreasing_fills_the_gaps_next_fit_leaves():
  # Width 10, rows 6, 6, 4, 4: next-fit in row order needs 3 bins (6 | 6 4 | 4), FFD 2 (6 4 | 6 4).
  start, num_bins = packing.first_fit_decreasing(jnp.asarray([6, 6, 4, 4], jnp.int32), 10)
  assert int(num_bins) == 2 and _next_fit_bins([6, 6, 4, 4], 10) == 3
  np.testing.assert_array_equal(np.asarray(start), [0, 10, 6, 16])
  # Random rows: every sequence in one bin, no two overlap, bins 0..num_bins-1 all used, never more
  # bins than next-fit on these draws.
  rng = np.random.default_rng(0)
  for trial in range(20):
    width = 48
    lengths = rng.integers(1, width + 1, 64) if trial % 2 else rng.geometric(0.08, 64).clip(1, width)
    start, num_bins = packing.first_fit_decreasing(jnp.asarray(lengths, jnp.int32), width)
    start, num_bins = np.asarray(start), int(num_bins)
    cover = np.zeros(64 * width, int)
    for s, n in zip(start, lengths):
      assert s // width == (s + n - 1) // width
      cover[s:s + n] += 1
    assert cover.max() == 1
    assert set(np.flatnonzero(cover) // width) == set(range(num_bins))
    assert num_bins <= _next_fit_bins(lengths, width)


def test_pack_shared_places_one_prompt_copy_per_chunk():
  r = _rollout(2)
  layout = packing.pack_shared(r.prompt_ids, r.prompt_mask, r.tokens, r.context_mask, G, bins_per_block=2)
  width = LP + T
  seg, pre = np.asarray(layout.segment_ids).reshape(-1), np.asarray(layout.prefix_ids).reshape(-1)
  tok, pos = np.asarray(layout.tokens).reshape(-1), np.asarray(layout.positions).reshape(-1)
  n = P * G
  copies = 0
  for i in range(n):
    plen, clen = int(r.prompt_mask[i].sum()), int(r.lengths[i])
    at = np.flatnonzero(seg == i + 1)                                  # the completion, contiguous
    assert len(at) == clen and np.all(np.diff(at) == 1) and at[0] == int(layout.first[i])
    np.testing.assert_array_equal(tok[at], np.asarray(r.tokens[i])[:clen])
    np.testing.assert_array_equal(pos[at], plen + np.arange(clen))
    prompt = np.flatnonzero(seg == pre[at[0]])                          # the prompt copy it continues
    assert len(prompt) == plen and prompt[-1] == int(layout.source[i]) and prompt[-1] < at[0]
    assert prompt[0] // width == at[-1] // width                        # copy and completion share a bin
    np.testing.assert_array_equal(tok[prompt], np.asarray(r.prompt_ids[i])[LP - plen:])
    np.testing.assert_array_equal(pos[prompt], np.arange(plen))
    copies += bool(layout.owns_prompt[i])
  assert P <= copies < n                                                # at least one per group, fewer than rows
  real = sum(int(r.prompt_mask[i].sum()) * bool(layout.owns_prompt[i]) + int(r.lengths[i]) for i in range(n))
  assert int((seg > 0).sum()) == real


@pytest.mark.parametrize("preset,pack_tokens", [("grpo", 0), ("grpo", 2 * (LP + T)), ("dr_grpo", 2 * (LP + T)),
                                                ("gspo", 0)])
def test_shared_prefix_update_equals_padded(preset, pack_tokens):
  """The shared-prefix update (one prompt copy per chunk of a group's completions) against the padded
  update that computes every row's prompt: loss, metrics, parameters, as test_packed_update_equals_padded."""
  kw = {"kl_coef": 0.0} if preset == "grpo" else {}
  loss_cfg = LossConfig.from_preset(preset, entropy_coef=0.01, **kw)
  mc, sp, optimizer, state = _tiny_update_setup()
  rollout = _rollout(3)
  micro = 1 if pack_tokens else 2
  base = StepSpec(model=mc, sampling=sp, loss=loss_cfg, prompts=P, micro_batches=micro)
  shared = StepSpec(model=mc, sampling=sp, loss=loss_cfg, prompts=P, micro_batches=micro, pack_tokens=pack_tokens,
                    shared_prefix=True)
  (s0, m0), (s1, m1) = (jax.jit(make_update_fn(spec, optimizer))(state, rollout) for spec in (base, shared))
  for key, value in m0.items():
    assert float(m1[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  if pack_tokens:   # fewer positions than packing every row with its own prompt
    packed = jax.jit(make_update_fn(StepSpec(model=mc, sampling=sp, loss=loss_cfg, prompts=P, pack_tokens=pack_tokens),
                                    optimizer))(state, rollout)[1]
    assert m1["packed_tokens"] <= packed["packed_tokens"]


@pytest.mark.parametrize("pack_tokens,shared", [(0, False), (2 * (LP + T), False), (2 * (LP + T), True)])
def test_sampler_gap_is_read_from_the_updates_own_forward(pack_tokens, shared):
  """One optimizer update per step: `sampler/logprob_gap_*` come from the update's forward (over every
  trained row) and equal a separate forward's figures on the same parameters."""
  from rljax.trainer.step import _gap_metrics, sequence_logprobs
  mc, sp, optimizer, state = _tiny_update_setup()
  rollout = _rollout(4)
  spec = StepSpec(model=mc, sampling=sp, loss=LossConfig.from_preset("grpo", kl_coef=0.0), prompts=P, gap_rows=G,
                  micro_batches=1 if pack_tokens else 2, pack_tokens=pack_tokens, shared_prefix=shared)
  metrics = jax.jit(make_update_fn(spec, optimizer))(state, rollout)[1]
  lp, _ = sequence_logprobs(spec, state.params, rollout.prompt_ids, rollout.prompt_mask, rollout.tokens,
                            rollout.context_mask)
  want = _gap_metrics(lp, rollout, P * G)
  for key, value in want.items():
    assert float(metrics[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key
  assert float(want["sampler/logprob_gap_mean"]) > 0.1      # the rollout's log-probs are not the model's


@pytest.mark.parametrize("shared", [False, True])
def test_packed_reference_and_recomputed_old_logprobs_equal_padded(shared):
  """With a reference model (KL) and lp_old recomputed (bf16 runs' default), the packed update computes
  those forwards over its packed blocks too: loss, metrics (kl_ref among them) and parameters equal the
  padded update's."""
  loss_cfg = LossConfig.from_preset("grpo", kl_coef=0.1, entropy_coef=0.01)
  mc, sp, optimizer, state = _tiny_update_setup(ref_scale=0.9)
  rollout = _rollout(5)
  outs = []
  for pack_tokens in (0, 2 * (LP + T)):
    spec = StepSpec(model=mc, sampling=sp, loss=loss_cfg, prompts=P, pack_tokens=pack_tokens,
                    shared_prefix=shared and pack_tokens > 0, recompute_old_logprobs=True, gap_rows=G)
    outs.append(jax.jit(make_update_fn(spec, optimizer))(state, rollout))
  (s0, m0), (s1, m1) = outs
  assert abs(float(m0["kl_ref"])) > 1e-4
  for key, value in m0.items():
    assert float(m1[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_packing_fields_are_validated_by_name():
  from rljax.config import base_config, validate
  from rljax.errors import ConfigError
  row = None
  for overrides, needle in [({"pack_width": 64}, r"config\.train\.pack_width=64 needs train\.pack_tokens"),
                            ({"pack_tokens": 4096, "pack_width": 8}, r"config\.train\.pack_width=8 must be between"),
                            ({"pack_tokens": 4096, "pack_width": 8192}, r"config\.train\.pack_width=8192 must be")]:
    c = base_config()
    row = c.data.max_prompt_tokens + c.sampling.max_new_tokens
    c.train.update(overrides)
    with pytest.raises(ConfigError, match=needle):
      validate(c)
  c = base_config()
  c.train.update(shared_prefix=True)
  c.model.attention = "splash"
  with pytest.raises(ConfigError, match=r"config\.train\.shared_prefix=True with model\.attention='splash'"):
    validate(c)
  c = base_config()
  c.train.update(pack_tokens=4 * row, pack_width=2 * row, shared_prefix=True)
  validate(c)
