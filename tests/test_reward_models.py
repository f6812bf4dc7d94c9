"""Reward models and generative judges scored in the compiled step (issue 35): parity with
transformers on the same templated text, on an 8-device mesh, and the refusals."""
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from models_testlib import hf_config, randomize_weights

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.rewards import RewardSpec
from rljax.rewards.reward_models import GraphScorer
from rljax.tokenizer import load_tokenizer

TOKENIZER = "smollm2-135m-instruct"
PROMPTS = ["What is 2 + 3?", "Name a colour of the sky on a clear day, in one word please."]
COMPLETIONS = [["It is 5.", "5"], ["Blue.", "The sky is blue most days and grey on others"]]
TEMPLATE = "Question: {prompt}\nAnswer:\n{completion}\nIs the answer correct? Reply yes or no."


def save_tiny(path, family: str, kind: str, tokenizer, seed: int = 0):
  """A tiny random HF reward model (`kind="model"`: *ForSequenceClassification, 1 label) or causal
  LM (`kind="judge"`) with the policy's tokenizer, saved to `path`; returns the torch model."""
  import torch
  import transformers
  config = hf_config(family)
  config.vocab_size = tokenizer.vocab_size
  config.hidden_size, config.intermediate_size = 32, 64
  if family == "qwen3":
    config.head_dim = 16
  config.pad_token_id = tokenizer.pad_id
  config.bos_token_id = config.eos_token_id = tokenizer.eos_id
  if kind == "model":
    config.num_labels = 1
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32,
                                                                        attn_implementation="eager")
  else:
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
  model = randomize_weights(model, seed)
  model.save_pretrained(str(path))
  tokenizer.save(str(path))
  return model


def _examples():
  return [{"id": str(i), "source": "qa", "prompt": p, "answer": "x",
           "prompt_messages": [{"role": "user", "content": p}]} for i, p in enumerate(PROMPTS)]


def _rows(tokenizer, width=24):
  """The completions as the sampler leaves them: ids [N, T], lengths [N]; row 1 of each group ends
  with the stop token, the others are cut off."""
  rows = [(tokenizer.encode(c) + ([tokenizer.eos_id] if j == 1 else [])) for cs in COMPLETIONS
          for j, c in enumerate(cs)]
  ids = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    ids[i, :len(r)] = r
  return ids, np.asarray([len(r) for r in rows], np.int32)


def _graph_scores(spec, tokenizer, examples, ids, lengths):
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  scorer = GraphScorer(spec, tokenizer, mesh, dtype="float32", stop_ids=tokenizer.stop_ids)
  inputs = scorer.inputs(examples, num_prompts=len(examples))
  n = ids.shape[0]

  @jax.jit
  def run(inputs, ids, lengths):
    with shd.activate(mesh):
      return scorer.scores(inputs, ids, lengths)

  ids, lengths = (jax.device_put(x, shd.batch_sharding(mesh, x.ndim, n)) for x in (ids, lengths))
  return scorer, np.asarray(run(inputs, ids, lengths))


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, tokenizer):
  import transformers
  d = tmp_path_factory.mktemp("tok")
  tokenizer.save(str(d))
  return transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_reward_model_matches_transformers(tmp_path, family, tokenizer, hf_tokenizer):
  """A tiny random *ForSequenceClassification: scores of prompt + completion in its chat template
  (transformers renders and tokenizes the text) equal AutoModelForSequenceClassification's, fp32."""
  import torch
  import transformers
  save_tiny(tmp_path, family, "model", tokenizer, seed=1)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                       attn_implementation="eager").eval()
  spec = RewardSpec.from_dict({"components": [{"name": "rm", "model": str(tmp_path)}], "num_workers": 0})
  ids, lengths = _rows(tokenizer)
  _, got = _graph_scores(spec, tokenizer, _examples(), ids, lengths)
  want = []
  for p, cs in zip(PROMPTS, COMPLETIONS):
    for c in cs:
      chat = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
      x = hf_tokenizer.apply_chat_template(chat, tokenize=True, return_tensors="pt", return_dict=True)["input_ids"]
      with torch.no_grad():
        want.append(float(hf(x).logits[0, 0]))
  assert got.shape == (4, 1)
  np.testing.assert_allclose(got[:, 0], want, atol=1e-4, rtol=0)
  assert np.ptp(want) > 1e-3        # the rows do get different scores


def test_judge_probabilities_match_transformers(tmp_path, tokenizer, hf_tokenizer):
  """A tiny random causal LM as a judge: P(yes) / (P(yes) + P(no)) and the expected value over a
  score-token set after the templated question equal those from transformers' next-token logits."""
  import torch
  import transformers
  save_tiny(tmp_path, "qwen2", "judge", tokenizer, seed=2)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
  spec = RewardSpec.from_dict({"components": [
      {"name": "yes", "judge": str(tmp_path), "template": TEMPLATE, "kwargs": {"yes": ["yes", "Yes"], "no": ["no"]}},
      {"name": "grade", "judge": str(tmp_path), "template": TEMPLATE, "kwargs": {"scores": {"1": 1, "2": 2, "3": 3}},
       "weight": 0.1},
      {"name": "p_yes", "judge": str(tmp_path), "template": TEMPLATE, "kwargs": {"yes": [" yes"]}, "weight": 0.0},
  ], "num_workers": 0})
  ids, lengths = _rows(tokenizer)
  _, got = _graph_scores(spec, tokenizer, _examples(), ids, lengths)
  want = []
  for p, cs in zip(PROMPTS, COMPLETIONS):
    for c in cs:
      chat = [{"role": "user", "content": TEMPLATE.format(prompt=p, completion=c)}]
      x = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
      with torch.no_grad():
        lp = torch.log_softmax(hf(x).logits[0, -1].double(), -1).numpy()
      yes, no = np.exp(lp[[10407, 10539]]).sum(), np.exp(lp[4607])
      grade = np.exp(lp[[33, 34, 35]]) / np.exp(lp[[33, 34, 35]]).sum()
      want.append([yes / (yes + no), grade @ [1, 2, 3], np.exp(lp[9805])])
  want = np.asarray(want)
  np.testing.assert_allclose(got[:, :2], want[:, :2], atol=1e-5, rtol=0)
  np.testing.assert_allclose(got[:, 2], want[:, 2], rtol=1e-4)     # an absolute probability, about 1 / V
  assert np.ptp(want[:, 0]) > 1e-4 and np.ptp(want[:, 2]) > 0.01 * want[:, 2].mean()


def test_refusals_name_the_field(tmp_path, tokenizer):
  save_tiny(tmp_path / "lm", "llama", "judge", tokenizer)
  cases = [
      ({"name": "j", "judge": "x"}, r"components\[0\] \('j'\): a judge needs a template"),
      ({"name": "j", "judge": "x", "template": "{prompt}", "kwargs": {"yes": ["y"]}}, r"must contain \{completion\}"),
      ({"name": "j", "judge": "x", "template": "{completion}"}, r"exactly one of 'yes'"),
      ({"name": "r", "model": "x", "verifier": "math"}, r"give one of verifier, model and judge"),
      ({"name": "r", "model": "x", "kwargs": {"yes": ["y"]}}, r"\['yes'\] are not options of a reward model"),
      ({"name": "r", "verifier": "math", "template": "{prompt}"}, r"template is for reward models and judges"),
      ({"name": "r", "model": str(tmp_path / "nope")}, r"\('r'\).model='.*nope': no such Hugging Face checkpoint"),
  ]
  for comp, match in cases:
    with pytest.raises(ConfigError, match=match):
      RewardSpec.from_dict({"components": [comp], "num_workers": 0})
  # At load: a causal LM given as a reward model; a yes string of two tokens; another vocabulary.
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  spec = RewardSpec.from_dict({"components": [{"name": "rm", "model": str(tmp_path / "lm")}], "num_workers": 0})
  with pytest.raises(ConfigError, match=r"\('rm'\).model=.* is a \['LlamaForCausalLM'\], not a "
                                        r"\*ForSequenceClassification"):
    GraphScorer(spec, tokenizer, mesh)
  spec = RewardSpec.from_dict({"components": [{"name": "j", "judge": str(tmp_path / "lm"), "template": TEMPLATE,
                                               "kwargs": {"yes": ["yes!"]}}], "num_workers": 0})
  with pytest.raises(ConfigError, match=r"'yes!' is 2 tokens"):
    GraphScorer(spec, tokenizer, mesh)
  other = tmp_path / "other"
  other.mkdir()
  tokenizer.save(str(other))
  data = json.loads((other / "tokenizer.json").read_text())
  vocab = data["model"]["vocab"]
  vocab["yes"], vocab["no"] = vocab["no"], vocab["yes"]
  (other / "tokenizer.json").write_text(json.dumps(data))
  for f in os.listdir(tmp_path / "lm"):
    if not f.startswith("tokenizer") and not f.startswith("special"):
      os.symlink(tmp_path / "lm" / f, other / f)
  spec = RewardSpec.from_dict({"components": [{"name": "j", "judge": str(other), "template": TEMPLATE,
                                               "kwargs": {"yes": ["yes"]}}], "num_workers": 0})
  with pytest.raises(ConfigError, match=r"does not share the policy's vocabulary \(2 of the policy's .* "
                                        r"'remote_judge'"):
    GraphScorer(spec, tokenizer, mesh)


def test_plan_counts_a_reward_model_in_the_fused_step(tmp_path, tokenizer):
  """`rljax plan`'s fused step takes the reward model's parameters (abstract, from config.json alone,
  sharded by param_shardings like the policy's) and runs its forward: its memory and FLOPs are part
  of the program the plan compiles."""
  from rljax.config import load_config_file
  from rljax.models.config import ModelConfig
  from rljax.models.policy import param_shardings
  from rljax.plan.programs import build_inputs, build_run, program_of
  from rljax.rewards.reward_models import SUFFIX_TOKENS, TEMPLATE_TOKENS
  save_tiny(tmp_path / "rm", "qwen2", "model", tokenizer)
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
  flops = {}
  for with_rm in (False, True):
    cfg = load_config_file(os.path.join(os.path.dirname(__file__), "..", "rljax", "configs", "smoke.py"))
    cfg.rewards.components = [dict(name="vowels", verifier="rljax.configs.smoke:vowel_fraction")] + (
        [dict(name="rm", model=str(tmp_path / "rm"), weight=0.5)] if with_rm else [])
    run = build_run(cfg)
    step, args = program_of("fused", run, mesh, build_inputs(run, mesh))
    flops[with_rm] = step.lower(*args).cost_analysis()["flops"]
  assert len(args) == 4
  rm = args[3]["params"]["rm"]
  config = ModelConfig.from_hf(json.loads((tmp_path / "rm" / "config.json").read_text()))
  config = config.replace(tie_word_embeddings=True, dtype=run.model.dtype, param_dtype=run.model.dtype)
  assert [x.sharding for x in jax.tree.leaves(rm["model"])] == jax.tree.leaves(param_shardings(config, mesh))
  assert rm["head"].shape == (config.hidden_size, 1)
  # Its forward: at least 2 FLOPs per layer weight and token of N rows x (prompt + template + T + suffix).
  d, f, h, k, dh = config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim
  weights = config.num_layers * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f)
  width = cfg.data.max_prompt_tokens + TEMPLATE_TOKENS + cfg.sampling.max_new_tokens + SUFFIX_TOKENS
  assert flops[True] - flops[False] >= 2 * weights * run.rows * width
