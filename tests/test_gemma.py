"""Gemma 2 and Gemma 3 (text): parity with transformers on tiny random models (fp32), the
Gemma-only pieces of attention and log-probs against naive references, the tokenizer and chat
template on a tiny sentencepiece model, and the random-model / multi-turn paths.

The tiny configs make every Gemma feature matter: a sliding window of 4 tokens (prompts of up to
7 and 10 new tokens), soft-caps small enough that tanh bends the scores, query_pre_attn_scalar !=
head_dim, separate local / global RoPE bases (Gemma 3) and norm offsets far from zero.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import left_padded_prompts

import rljax
from rljax.errors import ConfigError, WeightsError
from rljax.models import attention as attn
from rljax.models.config import ModelConfig
from rljax.models.convert import hf_to_params
from rljax.rl import LossConfig
from rljax.rl.logprobs import chunked_logprobs, naive_logprobs
from rljax.rollout import SamplingParams, sample
from rljax.trainer.step import StepSpec, sequence_logprobs

FAMILIES = ("gemma2", "gemma3")
VOCAB = 128
WINDOW = 4
LENGTHS = (7, 3, 5, 1)   # ragged prompts, left-padded to width 7
TOL = 1e-4


def _hf_model(family: str, seed: int = 0):
  """A tiny transformers Gemma with every weight random (norm offsets included)."""
  import torch
  import transformers
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                query_pre_attn_scalar=24, sliding_window=WINDOW, bos_token_id=2, eos_token_id=None, pad_token_id=0,
                tie_word_embeddings=True)
  if family == "gemma2":
    cfg = transformers.Gemma2Config(**common, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cls = transformers.Gemma2ForCausalLM
  else:
    cfg = transformers.Gemma3TextConfig(
        **common, layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    cls = transformers.Gemma3ForCausalLM
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = cls(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(0.3 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  model.generation_config.eos_token_id = None
  return model


def _ragged(lengths=LENGTHS, seed=0):
  return left_padded_prompts(lengths, VOCAB, low=3, seed=seed)


def _long_batch(seed=1):
  """[3, 12] rows longer than the window: full, left-padded, right-padded."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, VOCAB, (3, 12)).astype(np.int64)
  mask = np.ones((3, 12), bool)
  mask[1, :3] = False
  mask[2, 9:] = False
  ids[~mask] = 0
  return ids, mask


def _hf_logits(model, ids, mask):
  import torch
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                attention_mask=torch.as_tensor(mask.astype(np.int64)), position_ids=torch.as_tensor(positions))
  return out.logits.float().numpy()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """family -> (transformers model, its save_pretrained directory, rljax Policy loaded from it)."""
  out = {}
  for family in FAMILIES:
    hf = _hf_model(family)
    d = str(tmp_path_factory.mktemp(f"hf_{family}"))
    hf.save_pretrained(d)
    out[family] = (hf, d, rljax.load_pretrained(d))
  return out


# ---- config ------------------------------------------------------------------------------------


def test_config_switches_from_transformers(models):
  c2 = models["gemma2"][2].config
  assert c2.architecture == "gemma2" and c2.norm_offset and c2.sandwich_norms and c2.embed_scale
  assert c2.hidden_act == "gelu_tanh" and not c2.qk_norm and c2.tie_word_embeddings
  assert (c2.attn_logit_softcap, c2.final_logit_softcap, c2.query_pre_attn_scalar) == (3.0, 2.0, 24.0)
  assert c2.sliding_window == WINDOW and c2.sliding_layers == (True, False, True, False)
  assert c2.rope_local_theta is None and c2.attention_scale == 24.0 ** -0.5
  c3 = models["gemma3"][2].config
  assert c3.architecture == "gemma3" and c3.qk_norm and c3.attn_logit_softcap is None
  assert c3.final_logit_softcap is None and c3.sliding_layers == (True, False, True, True)
  assert (c3.rope_theta, c3.rope_local_theta) == (1_000_000.0, 100.0)
  # transformers 4.x field names (Gemma 3 1B's config.json): the pattern and the local base.
  legacy = {"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512, "sliding_window_pattern": 6,
            "rope_scaling": None, "query_pre_attn_scalar": 4, "eos_token_id": [1, 106]}
  c = ModelConfig.from_hf(legacy)
  assert c.sliding_layers == (True,) * 5 + (False, True) and c.rope_local_theta == 1e4
  assert c.eos_token_ids == (1, 106) and c.tie_word_embeddings
  with pytest.raises(WeightsError, match="multimodal"):
    ModelConfig.from_hf(dict(legacy, model_type="gemma3"))
  # Gemma 3 4B+'s linear scaling of the global layers (checked against transformers in test_rope.py).
  assert ModelConfig.from_hf(dict(legacy, rope_scaling={"rope_type": "linear", "factor": 8.0})).rope_scaling.factor == 8
  with pytest.raises(WeightsError, match="dynamic"):
    ModelConfig.from_hf(dict(legacy, rope_scaling={"rope_type": "dynamic", "factor": 8.0}))
  with pytest.raises(ConfigError, match="model.sliding_layers"):
    c.replace(sliding_layers=(True, False))
  # `rljax plan --layers A,B` compiles shallower copies: the per-layer pattern repeats.
  assert c.with_num_layers(8).sliding_layers == (True,) * 5 + (False, True, True)
  assert c.with_num_layers(2).sliding_layers == (True, True)
  assert models["gemma2"][2].config.with_num_layers(3).sliding_layers == (True, False, True)


# ---- forward, generation, log-probs ---------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, impl, models):
  hf, _, policy = models[family]
  policy = policy.with_params(policy.params)
  policy.config = policy.config.replace(attention=impl)
  for ids, mask in (_long_batch(), _ragged()):
    ref = _hf_logits(hf, ids, mask)
    got = np.asarray(policy(ids, mask))
    assert np.abs(got - ref)[mask].max() <= TOL


def _hf_greedy(model, ids, mask, new_tokens):
  import torch
  with torch.no_grad():
    out = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                         do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
  return out[:, ids.shape[1]:].numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, models):
  """The sampler (prompt cache shared by the group, sliding-window masks over both caches) picks
  transformers' greedy tokens, well past the window."""
  hf, _, policy = models[family]
  ids, mask = _ragged()
  t_new = 10
  ref = _hf_greedy(hf, ids, mask, t_new)
  sp = SamplingParams(num_samples=2, max_new_tokens=t_new, greedy=True)
  out = jax.jit(sample, static_argnums=(0, 4, 6))(policy.config, policy.params, ids, mask, sp, jax.random.key(0), ())
  tokens = np.asarray(out.grouped().tokens)
  for g in range(2):
    np.testing.assert_array_equal(tokens[:, g], ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_logprobs_equal_learner(family, models):
  """What the sampler records equals the learner's chunked, soft-capped log-probs."""
  _, _, policy = models[family]
  config, params = policy.config, policy.params
  ids, mask = _ragged()
  sp = SamplingParams(num_samples=3, max_new_tokens=12, temperature=0.8)
  out = jax.jit(sample, static_argnums=(0, 4, 6))(config, params, ids, mask, sp, jax.random.key(1), ())
  spec = StepSpec(model=config, sampling=sp, loss=LossConfig(), prompts=ids.shape[0], logprob_chunk=48)
  lp, ent = jax.jit(lambda *a: sequence_logprobs(spec, *a))(params, out.prompt_ids, out.prompt_mask, out.tokens,
                                                            out.mask)
  m = np.asarray(out.mask)
  assert m.sum() > 100
  assert np.abs(np.asarray(out.logprobs) - np.asarray(lp))[m].max() <= 2e-5
  assert np.abs(np.asarray(out.entropy) - np.asarray(ent))[m].max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip(family, models, tmp_path):
  """rljax.save_pretrained -> transformers loads it -> same logits; and rljax reloads it exactly."""
  import transformers
  _, _, policy = models[family]
  out = rljax.save_pretrained(policy, tmp_path / "export")
  cfg = json.load(open(os.path.join(out, "config.json")))
  assert cfg["architectures"] == [{"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]]
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert type(hf).__name__ == cfg["architectures"][0]
  ids, mask = _long_batch()
  assert np.abs(_hf_logits(hf, ids, mask) - np.asarray(policy(ids, mask)))[mask].max() <= TOL
  again = rljax.load_pretrained(out)
  assert again.config == policy.config
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(policy.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_memory_conversion_matches_directory_load(models):
  hf, _, policy = models["gemma3"]
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  params = hf_to_params(policy.config, sd.__getitem__, set(sd))
  assert set(params["layers"]) >= {"attn_out_norm", "mlp_out_norm", "post_attn_norm", "input_norm"}
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(policy.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the Gemma pieces against naive references -----------------------------------------------------


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 32), (1.3, 40)])
def test_softcapped_chunked_logprobs_match_naive(temperature, chunk):
  """Values and gradients of chunked_logprobs(softcap=c) equal the naive c * tanh(z / c) log-softmax."""
  kh, kw, ky, kg = jax.random.split(jax.random.key(0), 4)
  hidden = jax.random.normal(kh, (2, 5, 16))
  lm_head = 0.8 * jax.random.normal(kw, (16, 40))
  targets = jax.random.randint(ky, (2, 5), 0, 40)
  g_lp, g_ent = jax.random.normal(kg, (2, 2, 5))

  def loss(fn):
    def f(h, w):
      lp, ent = fn(h, w)
      return jnp.sum(lp * g_lp + ent * g_ent)
    return f

  chunked = lambda h, w: chunked_logprobs(h, w, targets, temperature, chunk_size=chunk, softcap=2.5)
  naive = lambda h, w: naive_logprobs(h, w, targets, temperature, softcap=2.5)
  for a, b in zip(chunked(hidden, lm_head), naive(hidden, lm_head)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  ga = jax.grad(loss(chunked), argnums=(0, 1))(hidden, lm_head)
  gb = jax.grad(loss(naive), argnums=(0, 1))(hidden, lm_head)
  for a, b in zip(ga, gb):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  # The cap changes the result (the test would pass vacuously otherwise).
  plain = naive_logprobs(hidden, lm_head, targets, temperature)[0]
  assert np.abs(np.asarray(plain) - np.asarray(chunked(hidden, lm_head)[0])).max() > 1e-2
  with pytest.raises(ValueError, match="softcap"):
    chunked_logprobs(hidden, lm_head, targets, softcap=0.0)


def test_chunked_attention_with_window_and_softcap_equals_xla():
  """The blockwise backend honours the window, the soft-cap and the scale, forward and backward
  (ragged and packed rows, blocks smaller than the window)."""
  b, t, kh, r, dh = 2, 13, 2, 2, 8
  keys = jax.random.split(jax.random.key(1), 4)
  q = 2.0 * jax.random.normal(keys[0], (b, t, kh, r, dh))
  k = 2.0 * jax.random.normal(keys[1], (b, t, kh, dh))
  v = jax.random.normal(keys[2], (b, t, kh, dh))
  w = jax.random.normal(keys[3], (b, t, kh, r, dh))
  token_mask = jnp.asarray(np.arange(t)[None] >= np.array([[0], [3]]))
  segment_ids = jnp.asarray(np.array([[0] * 6 + [1] * 7, [0] * 13]), jnp.int32)
  positions = jnp.asarray(np.array([list(range(6)) + list(range(7)), [0, 0, 0] + list(range(10))]), jnp.int32)
  for window in (jnp.int32(3), jnp.iinfo(jnp.int32).max):
    kw = dict(token_mask=token_mask, segment_ids=segment_ids, positions=positions, window=window, scale=0.3,
              softcap=2.0)
    run = lambda impl: jax.value_and_grad(
        lambda q, k, v: jnp.sum(attn.attend(q, k, v, impl=impl, block_q=4, block_k=3, **kw) * w),
        argnums=(0, 1, 2))(q, k, v)
    (va, ga), (vb, gb) = run("xla"), run("chunked")
    np.testing.assert_allclose(float(va), float(vb), rtol=1e-5)
    for a, bb in zip(ga, gb):
      np.testing.assert_allclose(np.asarray(a), np.asarray(bb), atol=1e-4)
  # The window and the cap both change the output.
  base = attn.attend(q, k, v, token_mask=token_mask, impl="xla")
  capped = attn.attend(q, k, v, token_mask=token_mask, impl="xla", softcap=2.0)
  windowed = attn.attend(q, k, v, token_mask=token_mask, impl="xla", positions=positions, window=jnp.int32(3))
  assert np.abs(np.asarray(base - capped)).max() > 1e-2 and np.abs(np.asarray(base - windowed)).max() > 1e-2


def test_backends_without_softcap_or_window_refuse_them():
  q = jnp.zeros((1, 4, 1, 1, 8), jnp.bfloat16)
  k = v = jnp.zeros((1, 4, 1, 8), jnp.bfloat16)
  for impl in ("cudnn", "splash"):
    with pytest.raises(ConfigError, match=r"config\.model\.attention=.*soft-capping"):
      attn.attend(q, k, v, impl=impl, softcap=50.0)
    with pytest.raises(ConfigError, match=r"config\.model\.attention"):
      attn.attend(q, k, v, impl=impl, positions=jnp.zeros((1, 4), jnp.int32), window=jnp.int32(2))
  assert attn.resolve("auto", 64, jnp.bfloat16, masking=True) == "xla"
  assert attn.resolve("auto", 4096, jnp.bfloat16, masking=True) == "chunked"


# ---- random Gemma models, training step and multi-turn tools ----------------------------------------


def _random_policy(family, window=WINDOW):
  from rljax.config import base_config
  from rljax.trainer.loop import load_policy
  c = base_config()
  c.model.path = "random"
  c.model.random.architecture = family
  c.model.random.num_layers = 2
  policy = load_policy(c.model, "smollm2-135m-instruct")
  policy.config = policy.config.replace(sliding_window=window)
  return policy


@pytest.mark.parametrize("family", FAMILIES)
def test_random_gemma_models_have_the_family_switches(family):
  policy = _random_policy(family)
  c = policy.config
  assert c.norm_offset and c.sandwich_norms and c.embed_scale and c.hidden_act == "gelu_tanh"
  assert c.qk_norm == (family == "gemma3") and (c.final_logit_softcap is not None) == (family == "gemma2")
  assert c.sliding_layers == ((True, False) if family == "gemma2" else (True, True))
  # Offset norms start at zero (a unit scale), as transformers initialises them.
  assert float(jnp.abs(policy.params["layers"]["attn_out_norm"]["scale"]).max()) == 0.0


def test_multi_turn_tool_rollout_on_gemma():
  """The tool engine on a Gemma model: feeding tool responses into the cache equals re-prefilling
  the history, and the sampler's log-probs equal the learner's (sliding windows across turns)."""
  from tools_testlib import scripted_tool_rollout

  from rljax.tools import ToolRunner
  policy = _random_policy("gemma2")
  tok = policy.tokenizer
  texts = ["Compute 2+3.", "Compute 10/4."]
  rows = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False)) for t in texts]
  width = max(len(r) for r in rows)
  ids, mask = np.zeros((2, width), np.int32), np.zeros((2, width), bool)
  for i, r in enumerate(rows):
    ids[i, width - len(r):], mask[i, width - len(r):] = r, True
  call = lambda e: tok.encode(f'Let me check. <tool_call>{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}'
                              "</tool_call>")
  script = {(0, 0): call("2+3"), (3, 0): call("10/4")}
  sp = SamplingParams(num_samples=2, max_new_tokens=96, temperature=1.0, stop_token_ids=tuple(tok.stop_ids))
  out = {}
  with ToolRunner(["calculator"], timeout_s=3.0, num_workers=1) as runner:
    for prefill in (False, True):   # resumed from the cache; the whole history prefilled again each round
      engine = scripted_tool_rollout(policy.config, tok, runner, sp, script, prefill=prefill, segment_tokens=8)
      out[prefill] = engine.run(policy.params, ids, mask, jax.random.key(7))[1].trajectories
  a, b = out[False], out[True]
  assert a.turns.tolist() == [1, 0, 0, 1]
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert np.abs(a.logprobs - b.logprobs).max() <= 1e-5
  spec = StepSpec(model=policy.config, sampling=sp, loss=LossConfig(), prompts=2)
  lp, _ = jax.jit(lambda *x: sequence_logprobs(spec, *x))(
      policy.params, jnp.repeat(ids, 2, 0), jnp.repeat(mask, 2, 0), a.tokens, a.context_mask)
  assert np.abs(np.where(a.model_mask, np.asarray(lp) - a.logprobs, 0.0)).max() <= 1e-5


# ---- tokenizer -------------------------------------------------------------------------------------

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def test_sentencepiece_tokenizer_with_gemma_chat_template(tmp_path):
  """A tokenizer.model + tokenizer_config.json directory laid out like Gemma's: BOS from the
  template, turn markers as single ids, <end_of_turn> a stop token, plain text as sentencepiece."""
  spm = pytest.importorskip("sentencepiece")
  from test_tokenizer_sentencepiece import _training_lines

  from rljax.tokenizer import load_tokenizer
  # Like Gemma's: BPE, byte fallback, no normalization or dummy prefix, digits split.
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_training_lines()), model_prefix=str(tmp_path / "tokenizer"), vocab_size=400,
      model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, split_digits=True, character_coverage=0.9995, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
      pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
      user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2, num_threads=1)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
      "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": GEMMA_TEMPLATE}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 5]}))
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
  messages = [{"role": "user", "content": "the lazy dog "}, {"role": "assistant", "content": "a fox"},
              {"role": "user", "content": "jumps"}]
  text = tok.apply_chat_template(messages, add_generation_prompt=True)
  assert text == ("<bos><start_of_turn>user\nthe lazy dog<end_of_turn>\n<start_of_turn>model\na fox<end_of_turn>\n"
                  "<start_of_turn>user\njumps<end_of_turn>\n<start_of_turn>model\n")
  ids = tok.encode(text)
  start, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
  assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1 and ids.count(start) == 4 and ids.count(end) == 3
  assert end in tok.stop_ids and tok.eos_id in tok.stop_ids
  assert tok.decode(ids, skip_special_tokens=False) == text
  # Plain text: the same ids as sentencepiece; add_special_tokens=True prepends BOS (add_bos_token).
  processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
  sentence = "the quick brown fox 12 jumps"
  assert tok.encode(sentence) == processor.encode(sentence)
  assert tok.encode(sentence, add_special_tokens=True) == [tok.bos_id] + processor.encode(sentence)

  # The trainer's check that Gemma prompts start with <bos>.
  from rljax.data.batching import check_bos
  check_bos("gemma3", tok, True)
  check_bos("llama", tok, False)
  with pytest.raises(ConfigError, match=r"config\.data\.chat_template=False"):
    check_bos("gemma2", tok, False)
  other = tmp_path / "no_bos"
  other.mkdir()
  (other / "tokenizer.model").write_bytes((tmp_path / "tokenizer.model").read_bytes())
  (other / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<bos>", "eos_token": "<eos>", "chat_template": GEMMA_TEMPLATE.replace("{{ bos_token }}", "")}))
  with pytest.raises(ConfigError, match=r"config\.tokenizer: the chat template renders prompts that do not start"):
    check_bos("gemma3", load_tokenizer(other), True)
