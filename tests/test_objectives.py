"""The objectives around RL (rljax/objectives): their maths and their data, without a Trainer.

SFT's loss against transformers' cross-entropy; rft's row filter against an independent gradient;
distillation's zero point (teacher = student) and its reverse-KL gradient against the closed form;
the errors that name their field. One tiny model, one compiled update per objective.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers

import rljax
from rljax.config import base_config, validate
from rljax.config_overrides import load_config_file
from rljax.data import build_dataset
from rljax.errors import ConfigError, DataError
from rljax.models.policy import apply_model, init_params
from rljax.models.transformer import positions_from_mask
from rljax.objectives.losses import ce_loss, distill_advantages
from rljax.objectives.sft_data import SftBatcher
from rljax.rl import LossConfig, make_denominators, policy_loss
from rljax.rollout.draw import SamplingParams
from rljax.rollout.types import Rollout
from rljax.tokenizer import Tokenizer
from rljax.trainer.setup import check_same_vocabulary
from rljax.trainer.state import TrainState
from rljax.trainer.step import StepSpec, make_update_fn
from tests.models_testlib import VOCAB, hf_model

CE = LossConfig(mean_scope="none", std_scope="none", agg="token-mean")


def _opt(make, lr):
  """An optax optimizer as the trainer wraps its own (non-finite updates skipped and counted)."""
  return optax.apply_if_finite(make(lr), max_consecutive_errors=5)


def _rollout(seed=0, rows=4, lp_width=6, t=5, vocab=VOCAB, group=1, rewards=None):
  """A scored Rollout of random tokens: left-padded prompts, right-padded completions of lengths 5, 3, 4, 2, ..."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, (rows, lp_width)).astype(np.int32)
  pmask = np.ones((rows, lp_width), bool)
  pmask[1, :2] = pmask[3, :3] = False
  ids[~pmask] = 0
  tokens = rng.integers(3, vocab, (rows, t)).astype(np.int32)
  lengths = np.array([5, 3, 4, 2, 5, 1, 4, 3][:rows])
  mask = np.arange(t)[None, :] < lengths[:, None]
  tokens[~mask] = 0
  z = np.zeros((rows, t), np.float32)
  r = np.zeros(rows, np.float32) if rewards is None else np.asarray(rewards, np.float32)
  return Rollout(prompt_ids=jnp.asarray(ids), prompt_mask=jnp.asarray(pmask), tokens=jnp.asarray(tokens),
                 mask=jnp.asarray(mask), context_mask=jnp.asarray(mask), logprobs=jnp.asarray(z),
                 entropy=jnp.asarray(z), lengths=jnp.asarray(lengths, jnp.int32), truncated=jnp.zeros(rows, bool),
                 rewards=jnp.asarray(r), components=jnp.asarray(r)[:, None], group_size=group)


def _spec(model, objective, group=1, prompts=4, loss=CE, **kw):
  sp = SamplingParams(num_samples=group, max_new_tokens=5, temperature=0.7)   # CE must ignore the temperature
  return StepSpec(model=model, sampling=sp, loss=loss, prompts=prompts, objective=objective, **kw)


def test_sft_loss_and_gradient_equal_transformers_cross_entropy(tmp_path):
  """The sft update's loss (token mean over the target tokens, temperature 1 whatever sampling.temperature)
  equals torch's cross-entropy of a transformers model on the same masked tokens (fp32, 1e-5), and its
  gradient norm equals torch's (the update split into two micro-batches; and packed)."""
  import torch
  model = hf_model("llama")
  model.save_pretrained(tmp_path / "hf")
  policy = rljax.load_pretrained(str(tmp_path / "hf"))
  ro = _rollout()
  opt = _opt(optax.sgd, 0.0)
  spec = _spec(policy.config, "sft", micro_batches=2)   # two micro-batches sum to the step's loss and gradient
  _, metrics = jax.jit(make_update_fn(spec, opt))(TrainState.create(policy.params, opt, 0), ro)

  seq = np.concatenate([ro.prompt_ids, ro.tokens], 1)
  seq_mask = np.concatenate([ro.prompt_mask, ro.mask], 1)
  pos = np.maximum(np.cumsum(seq_mask, 1) - 1, 0)
  logits = model(input_ids=torch.tensor(seq, dtype=torch.long), attention_mask=torch.tensor(seq_mask, dtype=torch.long),
                 position_ids=torch.tensor(pos, dtype=torch.long)).logits
  lp_width = ro.prompt_ids.shape[1]
  pred = logits[:, lp_width - 1:-1]          # the logits that predict each completion token
  targets = torch.tensor(np.asarray(ro.tokens), dtype=torch.long)
  m = torch.tensor(np.asarray(ro.mask))
  ce = torch.nn.functional.cross_entropy(pred[m], targets[m])
  ce.backward()
  grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
  assert float(metrics["loss"]) == pytest.approx(ce.item(), rel=1e-5, abs=1e-5)
  assert float(metrics["nll"]) == pytest.approx(ce.item(), rel=1e-5, abs=1e-5)
  assert float(metrics["num_tokens"]) == int(np.asarray(ro.mask).sum())
  assert float(metrics["grad_norm"]) == pytest.approx(grad_norm, rel=1e-4)
  # The packed update (train.pack_tokens: real tokens only, rows packed into blocks) gives the same loss.
  packed = _spec(policy.config, "sft", pack_tokens=2 * (ro.prompt_ids.shape[1] + ro.tokens.shape[1]))
  _, metrics = jax.jit(make_update_fn(packed, opt))(TrainState.create(policy.params, opt, 0), ro)
  assert float(metrics["loss"]) == pytest.approx(ce.item(), rel=1e-5, abs=1e-5)


def test_ce_aggregation_token_mean_and_sequence_mean():
  """rl.agg under sft: token-mean is the mean over all target tokens, seq-mean-token-mean the mean of
  each row's mean (rows of 3 and 1 tokens weigh the same)."""
  lp = -jnp.array([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
  for agg, want in (("token-mean", (1 + 2 + 3 + 5) / 4), ("seq-mean-token-mean", (2 + 5) / 2)):
    cfg = LossConfig(mean_scope="none", std_scope="none", agg=agg)
    loss, _ = ce_loss(lp, mask, make_denominators(mask, 1, cfg), cfg)
    assert float(loss) == pytest.approx(want)


def _tiny_model():
  from rljax.models.config import ModelConfig
  return ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=64)


def test_rft_trains_only_on_rows_whose_reward_reaches_the_threshold():
  """With SGD at lr 1 the rft update moves the parameters by minus the gradient of an independent
  cross-entropy (naive log-softmax) over the kept rows' tokens only; rejected rows contribute nothing. The
  update runs in two micro-batches (one group each), so this also shows they sum to the whole step's."""
  mc = _tiny_model()
  params = init_params(mc, jax.random.key(0))
  ro = _rollout(rows=4, group=2, rewards=[1.0, 0.0, 0.5, 1.5])   # min_reward 1.0 keeps rows 0 and 3
  opt = _opt(optax.sgd, 1.0)
  update = jax.jit(make_update_fn(_spec(mc, "rft", group=2, prompts=2, min_reward=1.0, micro_batches=2), opt))
  state, metrics = update(TrainState.create(params, opt, 0), ro)
  keep = np.array([True, False, False, True])
  assert float(metrics["rft/kept_fraction"]) == 0.5 and float(metrics["rft/kept_rows"]) == 2
  assert float(metrics["num_tokens"]) == int(np.asarray(ro.mask)[keep].sum())

  def naive_ce(p):
    seq = jnp.concatenate([ro.prompt_ids, ro.tokens], 1)
    seq_mask = jnp.concatenate([ro.prompt_mask, ro.mask], 1)
    logits = apply_model(mc, p, seq, positions_from_mask(seq_mask), seq_mask).logits
    lp_all = jax.nn.log_softmax(logits[:, ro.prompt_ids.shape[1] - 1:-1].astype(jnp.float32), -1)
    lp = jnp.take_along_axis(lp_all, ro.tokens[..., None], -1)[..., 0]
    m = ro.mask & jnp.asarray(keep)[:, None]
    return -jnp.sum(jnp.where(m, lp, 0.0)) / m.sum()

  want, grads = jax.value_and_grad(naive_ce)(params)
  assert float(metrics["loss"]) == pytest.approx(float(want), rel=1e-5)
  moved = jax.tree.map(lambda a, b: a - b, params, state.params)
  for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_distill_teacher_equal_to_student_gives_zero_loss_and_gradient():
  """The advantage is lp_teacher - lp_old with lp_old the learner's own forward: a teacher with the
  student's parameters gives exactly 0 per token, so loss and gradient are 0 and nothing moves."""
  mc = _tiny_model()
  params = init_params(mc, jax.random.key(1))
  loss = LossConfig.from_preset("grpo", kl_coef=0.0, mean_scope="none", std_scope="none", tis_cap=2.0)
  spec = _spec(mc, "distill", group=1, prompts=4, loss=loss, teacher=mc, recompute_old_logprobs=True)
  opt = _opt(optax.adam, 1e-2)
  state = TrainState.create(params, opt, 0, teacher=jax.tree.map(jnp.copy, params))
  new, metrics = jax.jit(make_update_fn(spec, opt))(state, _rollout(seed=3))
  assert float(metrics["distill/reverse_kl"]) == 0.0
  assert float(metrics["loss"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reverse_kl_advantage_gives_the_closed_form_gradient_on_a_toy_vocabulary():
  """On one position with a vocabulary of 7: the policy-gradient loss with A = lp_teacher - lp_student,
  averaged over the tokens the student would draw (weights pi(y)), has the gradient of KL(pi || q):
  d/dz KL = pi * (d - E_pi[d]), d = log pi - log q, z the student's logits."""
  rng = np.random.default_rng(0)
  z, zq = (jnp.asarray(rng.normal(size=7), jnp.float32) for _ in range(2))
  lq = jax.nn.log_softmax(zq)
  cfg = LossConfig.from_preset("grpo", kl_coef=0.0, mean_scope="none", std_scope="none")
  one = jnp.ones((1, 1), bool)
  den = make_denominators(one, 1, cfg)

  def token_loss(logits, y):
    lp = jax.nn.log_softmax(logits)[y].reshape(1, 1)
    adv = distill_advantages(jax.lax.stop_gradient(lp), lq[y].reshape(1, 1), one)
    return policy_loss(lp, jax.lax.stop_gradient(lp), adv, one, den, cfg)[0]

  pi = jax.nn.softmax(z)
  grads = jax.vmap(jax.grad(token_loss), in_axes=(None, 0))(z, jnp.arange(7))   # [V(y), V(z)]
  expected = (pi[:, None] * grads).sum(0)
  d = jnp.log(pi) - lq
  closed = pi * (d - jnp.sum(pi * d))
  np.testing.assert_allclose(np.asarray(expected), np.asarray(closed), rtol=1e-5, atol=1e-7)
  kl = lambda logits: jnp.sum(jax.nn.softmax(logits) * (jax.nn.log_softmax(logits) - lq))
  np.testing.assert_allclose(np.asarray(closed), np.asarray(jax.grad(kl)(z)), rtol=1e-5, atol=1e-7)


# ---- data and settings that stop with a message naming the field ----------------------------------


def _tokenizer():
  return rljax.load_tokenizer("smollm2-135m-instruct")


def _batcher(tmp_path, rows, template="{response}", fields=None, chat_template=True):
  path = tmp_path / "sft.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  src = dict(kind="jsonl", path=str(path), verifier="none", fields={"answer": None, **(fields or {})})
  ds = build_dataset({"sources": [src], "chat_template": chat_template, "shuffle": False, "max_prompt_tokens": 64})
  return SftBatcher(ds, _tokenizer(), prompts_per_batch=len(rows), max_target_tokens=32, response_template=template)


def test_sft_targets_follow_the_chat_template_and_train_on_assistant_turns(tmp_path):
  """A response is the assistant turn the template writes (trained up to and including <|im_end|>);
  chat messages train on every assistant turn and only see the user turn between them."""
  tok = _tokenizer()
  im_end = tok.token_to_id("<|im_end|>")
  batch = next(_batcher(tmp_path, [{"prompt": "What is 2 + 2?", "response": "4"}]))
  ids = batch.tokens[0][batch.context_mask[0]].tolist()
  assert tok.decode(ids, skip_special_tokens=False) == "4<|im_end|>\n"
  assert batch.tokens[0][batch.mask[0]].tolist() == tok.encode("4") + [im_end]
  conv = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"},
          {"role": "user", "content": "and 2 + 2?"}, {"role": "assistant", "content": "4"}]
  batch = next(_batcher(tmp_path, [{"messages": conv}], fields={"messages": "messages"}))
  trained = tok.decode(batch.tokens[0][batch.mask[0]].tolist(), skip_special_tokens=False)
  seen = tok.decode(batch.tokens[0][batch.context_mask[0]].tolist(), skip_special_tokens=False)
  assert trained == "2<|im_end|>4<|im_end|>"
  assert "and 2 + 2?" in seen and "and 2 + 2?" not in trained
  assert batch.prompt_ids.shape[0] == 1 and "1 + 1?" in tok.decode(batch.prompt_ids[0][batch.prompt_mask[0]].tolist())


def test_sft_row_without_a_response_stops_naming_the_field(tmp_path):
  with pytest.raises(DataError, match=r"no 'response'.*fields\.response"):
    next(_batcher(tmp_path, [{"prompt": "What is 2 + 2?", "answer": "4"}]))


def test_objective_settings_are_refused_by_name():
  def refused(match, **fields):
    c = base_config()
    for key, value in fields.items():
      section, name = key.split("__")
      c[section][name] = value
    with pytest.raises(ConfigError, match=match):
      validate(c)

  refused(r"config\.distill\.teacher is empty", train__objective="distill")
  refused(r"config\.train\.objective='ppo'", train__objective="ppo")
  refused(r"config\.distill\.teacher=.*only applies to train\.objective='distill'", distill__teacher="x")
  refused(r"config\.rft\.min_reward=.*only applies", rft__min_reward=0.5)
  refused(r"config\.rl\.preset='dapo' has no effect with train\.objective='sft'", train__objective="sft",
          rl__preset="dapo")
  refused(r"config\.rollout\.mode='pipelined' with train\.objective='sft'", train__objective="sft",
          rollout__mode="pipelined")


def test_a_teacher_with_another_vocabulary_is_refused_naming_distill_teacher():
  mc = _tiny_model()
  with pytest.raises(ConfigError, match=r"config\.distill\.teacher='t'.*fewer than the student's"):
    check_same_vocabulary("t", mc.replace(vocab_size=VOCAB // 2), None, mc, None)
  words = lambda vocab: Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")))
  a = words({"<unk>": 0, "one": 1, "two": 2})
  b = words({"<unk>": 0, "two": 1, "one": 2})
  check_same_vocabulary("t", mc, a, mc, words({"<unk>": 0, "one": 1, "two": 2}))   # the same: accepted
  with pytest.raises(ConfigError, match=r"config\.distill\.teacher='t': its tokenizer is not the student's"):
    check_same_vocabulary("t", mc, b, mc, a)


@pytest.mark.parametrize("name", ["sft_arithmetic.py", "rl_after_sft.py", "distill_arithmetic.py"])
def test_stage_recipes_validate(name):
  """The stage recipes (run on a tiny model in test_objectives_runs.py for sft) are valid configs."""
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", name))
  validate(cfg)
  assert cfg.train.objective == {"sft_arithmetic.py": "sft", "rl_after_sft.py": "rl"}.get(name, "distill")


def test_distill_reward_weight_adds_the_reward_advantage_per_token():
  """distill.reward_weight = w adds w * A_i (the rows' reward advantage) to every token's advantage: with the
  teacher equal to the student (reverse-KL part 0) the loss and gradient are w times the rl update's."""
  mc = _tiny_model()
  params = init_params(mc, jax.random.key(2))
  loss = LossConfig.from_preset("grpo", kl_coef=0.0)
  ro = _rollout(seed=4, rows=4, group=2, rewards=[1.0, 0.0, 0.2, 0.9])
  opt = _opt(optax.sgd, 0.0)
  out = {}
  for objective, extra in (("rl", {}), ("distill", dict(teacher=mc, reward_weight=0.5))):
    spec = _spec(mc, objective, group=2, prompts=2, loss=loss, recompute_old_logprobs=True, **extra)
    state = TrainState.create(params, opt, 0, teacher=params if objective == "distill" else None)
    out[objective] = jax.jit(make_update_fn(spec, opt))(state, ro)[1]
  assert float(out["rl"]["loss"]) != 0.0
  assert float(out["distill"]["loss"]) == pytest.approx(0.5 * float(out["rl"]["loss"]), rel=1e-5)
  assert float(out["distill"]["grad_norm"]) == pytest.approx(0.5 * float(out["rl"]["grad_norm"]), rel=1e-5)
