"""Rewards computed inside the compiled step: reward models and generative judges on the mesh.

    {"name": "rm", "model": "/path/to/Skywork-Reward-...", "weight": 1.0}        # *ForSequenceClassification
    {"name": "judge", "judge": "/path/to/Qwen2.5-0.5B-Instruct", "weight": 1.0,  # a causal LM
     "template": "Question: {prompt}\\nAnswer: {completion}\\nIs the answer correct? Reply yes or no.",
     "kwargs": {"yes": ["yes", "Yes"], "no": ["no", "No"]}}

A reward model scores prompt + completion with its `score` head at the last token; a judge's score
is the probability its next token after the templated text is one of the `yes` tokens (normalised
against the `no` tokens when given), or the expected value over a set of score tokens
(`scores: {"1": 1, ..., "5": 5}`). Both run after sampling, in the same compiled program, on the
sampled token ids: no detokenization, no host round trip. Their parameters are frozen, stored in
the compute dtype and sharded over the mesh by the same logical-axis rules as the policy and its
reference copy (`param_shardings`).

Texts. Each model sees its own chat template: the prompt side (the example's messages, or the
`template` formatted with the example's fields) is rendered and tokenized by the model's tokenizer
on the host before the step, as input data (`GraphScorer.inputs`), split around the completion: a
prefix [P, Lq] (left-padded) and a suffix [P, Ls] (the end of the assistant turn for a reward
model; the rest of the template and the generation prompt for a judge). In the step the rows are
assembled as prefix + completion (its final stop token dropped: the template ends the turn) +
suffix (`assemble`). This needs the model to share the policy's vocabulary (checked: every token
of the policy's tokenizer has the same id in the model's); a model with another vocabulary is
refused: its text would have to be detokenized and re-tokenized, which needs the host (use a
`batch` verifier or the remote judge for those). The completion's sampled ids are used as they are,
so they equal the model's tokenization of the text when the sampled ids are the canonical
tokenization (a sampler may emit a non-canonical split of the same text; the model then sees
other ids for the same string).
"""
from __future__ import annotations

import dataclasses
import os
import string
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import ConfigError

SENTINEL = "\u2063RLJAX-COMPLETION\u2063"   # stands for the completion while templates are rendered
JUDGE_KWARGS = ("yes", "no", "scores", "system", "response_prefix", "dtype")
MODEL_KWARGS = ("label", "dtype")


@dataclasses.dataclass(frozen=True)
class GraphComponent:
  """What the compiled program needs to know about one in-graph component (static)."""
  name: str
  kind: str                            # "model" (reward model) | "judge"
  config: Any                          # the model's rljax ModelConfig
  label: int = 0                       # reward model: the column of the score head
  token_ids: tuple[int, ...] = ()      # judge: the yes tokens, or the score tokens
  no_ids: tuple[int, ...] = ()         # judge: the no tokens (normalise against them)
  values: tuple[float, ...] = ()       # judge with a score set: the value of each score token


def template_fields(template: str, where: str) -> list[str]:
  try:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
  except ValueError as e:
    raise ConfigError(f"{where}.template={template!r} is not a format string ({e}); write literal braces as "
                      "'{{' and '}}'.") from None


def check_component(c, where: str) -> None:
  """Config checks of an in-graph component that need no files (RewardSpec.validate)."""
  kind = "judge" if c.judge is not None else "model"
  path = c.judge if c.judge is not None else c.model
  if c.verifier is not None:
    raise ConfigError(f"{where}: give one of verifier, model and judge (it has verifier={c.verifier!r} and "
                      f"{kind}={path!r}).")
  if c.model is not None and c.judge is not None:
    raise ConfigError(f"{where}: give one of model (a reward model) and judge (a generative judge), not both.")
  if not isinstance(path, str) or not path:
    raise ConfigError(f"{where}.{kind} must be the path of a Hugging Face checkpoint directory, got {path!r}.")
  allowed = JUDGE_KWARGS if kind == "judge" else MODEL_KWARGS
  unknown = sorted(set(c.kwargs) - set(allowed))
  if unknown:
    raise ConfigError(f"{where}.kwargs: {unknown} are not options of a {'judge' if kind == 'judge' else 'reward model'}"
                      f"; they are {list(allowed)}.")
  if c.template is not None:
    if not isinstance(c.template, str):
      raise ConfigError(f"{where}.template must be a string, got {type(c.template).__name__}.")
    fields = template_fields(c.template, where)
    if kind == "judge" and "completion" not in fields:
      raise ConfigError(f"{where}.template must contain {{completion}} (where the judge reads the completion); "
                        f"it has {sorted(set(fields))}.")
    if kind == "model" and "completion" in fields:
      raise ConfigError(f"{where}.template is the reward model's user message; the completion is its assistant "
                        "turn: drop {completion} from the template.")
  elif kind == "judge":
    raise ConfigError(f"{where}: a judge needs a template, the question it answers, with {{completion}} (and "
                      "{prompt}, {answer} or other example fields), e.g. 'Question: {prompt}\\nAnswer: "
                      "{completion}\\nIs the answer correct? Reply yes or no.'")
  kw = c.kwargs
  if kind == "judge":
    if ("yes" in kw) == ("scores" in kw):
      raise ConfigError(f"{where}.kwargs: a judge needs exactly one of 'yes' (token strings whose probability is the "
                        "score, e.g. ['yes', 'Yes']) and 'scores' (token -> value, e.g. {'1': 1, '2': 2})")
    for key in ("yes", "no"):
      if key in kw and (isinstance(kw[key], str) or not isinstance(kw[key], Sequence) or not kw[key] or
                        not all(isinstance(t, str) and t for t in kw[key])):
        raise ConfigError(f"{where}.kwargs.{key} must be a non-empty list of token strings, got {kw[key]!r}.")
    if "scores" in kw and (not isinstance(kw["scores"], Mapping) or len(kw["scores"]) < 2 or
                           not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                   for v in kw["scores"].values())):
      raise ConfigError(f"{where}.kwargs.scores must map at least two token strings to numbers, got {kw['scores']!r}.")
  elif "label" in kw and (isinstance(kw["label"], bool) or not isinstance(kw["label"], int) or kw["label"] < 0):
    raise ConfigError(f"{where}.kwargs.label must be an int >= 0 (a column of the score head), got {kw['label']!r}.")
  if "dtype" in kw and kw["dtype"] not in ("float32", "bfloat16"):
    raise ConfigError(f"{where}.kwargs.dtype must be 'float32' or 'bfloat16', got {kw['dtype']!r}.")
  if not is_checkpoint_dir(os.path.expanduser(path)):
    raise ConfigError(f"{where}.{kind}={path!r}: no such Hugging Face checkpoint directory (config.json, safetensors "
                      f"weights, tokenizer files); give the directory of a "
                      f"{'*ForSequenceClassification reward model' if kind == 'model' else 'causal LM'}.")


# ---- the prompt side (host) ------------------------------------------------------------------------


def _fields(example: Mapping[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in example.items() if isinstance(k, str)}


def render_pieces(tokenizer, kind: str, template: str | None, example: Mapping[str, Any], *, system: str | None = None,
                  response_prefix: str = "", where: str = "reward model") -> tuple[list[int], list[int]]:
  """The token ids before and after the completion in the model's view of one example.

  A reward model sees the example's messages (or `template` as the user message) and the
  completion as the assistant turn, in its chat template; a judge sees `template` (with
  {completion}) as the user message, then its generation prompt and `response_prefix`.
  """
  messages = []
  if kind == "model":
    if template is None:
      messages = [dict(m) for m in example.get("prompt_messages") or [{"role": "user", "content": example["prompt"]}]]
    else:
      messages = [{"role": "user", "content": template.format_map(_Missing(_fields(example), where))}]
    messages.append({"role": "assistant", "content": SENTINEL})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
  else:
    if system:
      messages.append({"role": "system", "content": system})
    fields = {**_fields(example), "completion": SENTINEL}
    messages.append({"role": "user", "content": template.format_map(_Missing(fields, where))})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + response_prefix
  if text.count(SENTINEL) != 1:
    raise ConfigError(f"{where}: its chat template does not reproduce the completion exactly once (it appears "
                      f"{text.count(SENTINEL)} times in the rendered text); it cannot be scored in the step.")
  before, after = text.split(SENTINEL)
  return tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)


class _Missing(dict):
  """format_map's mapping: an unknown field is an error naming it and the example's fields."""

  def __init__(self, fields: Mapping[str, Any], where: str):
    super().__init__(fields)
    self.where = where

  def __missing__(self, key):
    raise ConfigError(f"{self.where}.template: the example has no field {key!r} (it has {sorted(self)}).")


def check_vocabulary(policy_tokenizer, model_tokenizer, where: str) -> None:
  """Refuses a model whose vocabulary does not contain the policy's with the same ids."""
  mine = policy_tokenizer.backend.get_vocab(with_added_tokens=True)
  theirs = model_tokenizer.backend.get_vocab(with_added_tokens=True)
  differ = [tok for tok, i in mine.items() if theirs.get(tok) != i]
  if differ:
    raise ConfigError(
        f"{where}: its tokenizer does not share the policy's vocabulary ({len(differ)} of the policy's {len(mine)} "
        f"tokens have another id or none, e.g. {differ[0]!r}); an in-graph reward model or judge reads the sampled "
        "ids as they are. Use a model of the policy's family (same tokenizer), or score on the host: a 'batch' "
        "verifier that runs the model, or the remote judge (verifier 'remote_judge').")


def pad_pieces(pieces: Sequence[tuple[list[int], list[int]]], pad_id: int, width: int | None = None,
               suffix_width: int | None = None) -> dict[str, np.ndarray]:
  """Host arrays of the prefix (left-padded) and suffix (right-padded) ids of P examples:
  prefix [P, Lq] int32, prefix_mask [P, Lq] bool, suffix [P, Ls] int32, suffix_len [P] int32."""
  from rljax.data.batching import bucket_width
  lq = width or bucket_width(max(len(p) for p, _ in pieces))
  ls = suffix_width or bucket_width(max(len(s) for _, s in pieces), pad_multiple=8)
  n = len(pieces)
  prefix = np.full((n, lq), pad_id, np.int32)
  mask = np.zeros((n, lq), bool)
  suffix = np.full((n, ls), pad_id, np.int32)
  suffix_len = np.zeros(n, np.int32)
  for i, (p, s) in enumerate(pieces):
    if len(p) > lq or len(s) > ls:
      raise ValueError(f"prompt pieces of {len(p)} + {len(s)} tokens do not fit widths {lq} + {ls}")
    prefix[i, lq - len(p):] = p
    mask[i, lq - len(p):] = True
    suffix[i, :len(s)] = s
    suffix_len[i] = len(s)
  return {"prefix": prefix, "prefix_mask": mask, "suffix": suffix, "suffix_len": suffix_len}


# ---- in the step -----------------------------------------------------------------------------------


def assemble(prefix, prefix_mask, tokens, lengths, suffix, suffix_len, stop_ids: tuple[int, ...], pad_id: int = 0):
  """The model's input rows: prefix [N, Lq] (left-padded) + completion tokens [N, T] (the first
  `lengths` valid, a final stop token dropped) + suffix [N, Ls] (the first `suffix_len` valid).

  Returns (ids [N, W] int32, mask [N, W] bool, last [N] int32), W = Lq + T + Ls: the row's real
  tokens are contiguous after its left padding, `last` is the index of its last one.
  """
  import jax.numpy as jnp
  n, lq = prefix.shape
  t = tokens.shape[1]
  lengths = lengths.astype(jnp.int32)
  if stop_ids:
    end = jnp.take_along_axis(tokens, jnp.clip(lengths - 1, 0, t - 1)[:, None], axis=1)[:, 0]
    lengths = lengths - ((lengths > 0) & jnp.isin(end, jnp.asarray(stop_ids, tokens.dtype))).astype(jnp.int32)
  row = jnp.concatenate([prefix, tokens.astype(prefix.dtype), suffix], axis=1)       # [N, Lq + T + Ls]
  j = jnp.arange(row.shape[1], dtype=jnp.int32)[None, :]
  c = (lq + lengths)[:, None]
  src = jnp.where(j < c, j, j - c + lq + t)
  ids = jnp.take_along_axis(row, jnp.clip(src, 0, row.shape[1] - 1), axis=1)
  real = jnp.concatenate([prefix_mask, jnp.zeros((n, t + suffix.shape[1]), bool)], axis=1)
  mask = real | ((j >= lq) & (j < c + suffix_len[:, None]))
  ids = jnp.where(mask, ids, pad_id)
  last = lq + lengths + suffix_len - 1
  return ids, mask, last


def component_scores(gc: GraphComponent, params, ids, mask, last):
  """[N] float32 scores of one in-graph component on assembled rows (ids, mask [N, W], last [N])."""
  import jax
  import jax.numpy as jnp

  from rljax.models.policy import apply_model
  from rljax.models.transformer import Transformer, positions_from_mask
  hidden = apply_model(gc.config, params["model"], ids, positions_from_mask(mask), mask, return_hidden=True).hidden
  h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]                  # [N, D]
  if gc.kind == "model":
    head = params["head"][:, gc.label].astype(h.dtype)
    return jnp.einsum("nd,d->n", h, head, preferred_element_type=jnp.float32)
  # Only the last position's logits: [N, V] (soft-capped as the model's own logits are).
  logits = Transformer(gc.config).apply({"params": params["model"]}, h, method=Transformer.hidden_to_logits)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = logp[:, jnp.asarray(gc.token_ids)]                                            # [N, S]
  if gc.values:
    weights = jax.nn.softmax(picked, axis=-1)
    return weights @ jnp.asarray(gc.values, jnp.float32)
  yes = jax.nn.logsumexp(picked, axis=-1)
  if not gc.no_ids:
    return jnp.exp(yes)
  no = jax.nn.logsumexp(logp[:, jnp.asarray(gc.no_ids)], axis=-1)
  return jax.nn.sigmoid(yes - no)                                                        # P(yes) / (P(yes) + P(no))


def token_ids(tokenizer, strings: Sequence[str], where: str) -> tuple[int, ...]:
  """The single token id of each string (ConfigError for a string that is not one token)."""
  out = []
  for s in strings:
    ids = tokenizer.encode(s, add_special_tokens=False)
    if len(ids) != 1:
      raise ConfigError(f"{where}: {s!r} is {len(ids)} tokens for the judge's tokenizer ({ids}); list strings that "
                        "are one token each (e.g. 'yes' and ' yes' are different tokens).")
    out.append(ids[0])
  return tuple(out)


def is_checkpoint_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "config.json"))
