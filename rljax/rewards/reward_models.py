"""`GraphScorer`: the reward models and judges of a RewardSpec, loaded onto the mesh and scored in
the compiled step (the functions it runs: rljax/rewards/graph.py; docs/rewards.md).

    scorer = GraphScorer(spec, policy_tokenizer, mesh, dtype="bfloat16", stop_ids=(eos,))
    inputs = scorer.inputs(examples, num_prompts=P)           # host, before the step: params + prompt pieces
    ...inside jit (with the mesh active):
    scores = scorer.scores(inputs, tokens, lengths)           # [N, K_graph] float32, spec order of its components

The scores join the host's verifier scores in the reward callback (`RewardFn`), where weights,
gates, routing (`sources`) and metrics treat them like any other component's.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import ConfigError, WeightsError
from rljax.rewards import graph
from rljax.rewards.graph import GraphComponent

SCORE_HEAD = "score.weight"


@dataclasses.dataclass
class _Host:
  """The host side of one component: its tokenizer and how it renders an example."""
  tokenizer: Any
  kind: str
  template: str | None
  system: str | None
  response_prefix: str
  pad_id: int
  where: str


def _tokenizer(path: str, where: str):
  from rljax.tokenizer import load_tokenizer
  try:
    return load_tokenizer(path)
  except Exception as e:  # noqa: BLE001 - TokenizerError or a missing file: name the component
    raise ConfigError(f"{where}: cannot load the tokenizer of {path!r} ({e}); an in-graph reward model or judge "
                      "needs its tokenizer files (tokenizer.json and its chat template) in the checkpoint "
                      "directory.") from None


def load_reward_model(path: str, mesh, dtype: str, where: str):
  """(ModelConfig, {"model": params, "head": [D, L]}) of a Hugging Face `*ForSequenceClassification`
  directory: the backbone as rljax loads a causal LM (sharded by `param_shardings` on `mesh`, each
  process reading its slices) without an output projection, and the `score` head replicated."""
  import jax

  from rljax.models.config import ModelConfig
  from rljax.models.convert import hf_to_params
  from rljax.models.io import CONFIG_FILE, _check_shapes, _place_slices, _read_json, _SafetensorsCheckpoint
  from rljax.models.policy import param_shardings
  if not graph.is_checkpoint_dir(path):
    raise ConfigError(f"{where}.model={path!r}: not a Hugging Face checkpoint directory (no {CONFIG_FILE}).")
  hf = _read_json(os.path.join(path, CONFIG_FILE))
  archs = hf.get("architectures") or []
  if not any(str(a).endswith("ForSequenceClassification") for a in archs):
    raise ConfigError(f"{where}.model={path!r} is a {archs or 'model without architectures'}, not a "
                      "*ForSequenceClassification reward model (a causal LM scores as a judge: use judge=).")
  config = ModelConfig.from_hf(hf, os.path.join(path, CONFIG_FILE))
  # No output projection: the score head replaces it (tied = no lm_head parameter to load).
  config = config.replace(tie_word_embeddings=True, dtype=dtype, param_dtype=dtype)
  ckpt = _SafetensorsCheckpoint(path)
  if SCORE_HEAD not in ckpt.names:
    raise WeightsError(f"{ckpt.source}: tensor {SCORE_HEAD!r} is missing; a reward model has a score head "
                       "(LlamaForSequenceClassification and its Qwen/Gemma siblings).")
  backbone = {n for n in ckpt.names if n not in (SCORE_HEAD, "lm_head.weight")}
  _check_shapes(config, backbone, ckpt.shape, ckpt.file_of, CONFIG_FILE)
  head = np.asarray(ckpt.get(SCORE_HEAD), np.float32)                       # [L, D]
  if head.ndim != 2 or head.shape[1] != config.hidden_size:
    raise WeightsError(f"{ckpt.file_of(SCORE_HEAD)}: {SCORE_HEAD} has shape {head.shape}, expected "
                       f"[num_labels, {config.hidden_size}].")
  head = head.T.astype(np.dtype(config.storage_dtype))
  if mesh is None:
    params = jax.device_put(hf_to_params(config, ckpt.get, backbone, ckpt.source))
    return config, {"model": params, "head": jax.device_put(head)}
  params = _place_slices(config, ckpt, param_shardings(config, mesh))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return config, {"model": params, "head": jax.device_put(head, replicated)}


def load_judge(path: str, mesh, dtype: str, where: str):
  """(ModelConfig, {"model": params}) of a causal LM directory, sharded like the policy."""
  from rljax.models.io import load_pretrained
  if not graph.is_checkpoint_dir(path):
    raise ConfigError(f"{where}.judge={path!r}: not a Hugging Face checkpoint directory (no config.json).")
  policy = load_pretrained(path, dtype=dtype, param_dtype=dtype, mesh=mesh, tokenizer=False)
  return policy.config, {"model": policy.params}


class GraphScorer:
  """The in-graph components (`model:` / `judge:`) of a RewardSpec (module doc).

  Args:
    spec: the RewardSpec; only its components with `model` or `judge` are loaded.
    policy_tokenizer: the policy's tokenizer (each model must share its vocabulary).
    mesh: where the models' parameters live (sharded by the policy's rules); None: default device.
    dtype: the compute (and storage) dtype of the models, unless a component's kwargs.dtype says.
    stop_ids: the policy's stop tokens: a completion's final stop token is dropped before the
      model's own end of turn.
  """

  def __init__(self, spec, policy_tokenizer, mesh=None, *, dtype: str = "float32", stop_ids: Sequence[int] = ()):
    self.mesh = mesh
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.components: list[GraphComponent] = []
    self.positions: list[int] = []          # index of each in spec.components
    self.params: dict[str, Any] = {}
    self._hosts: list[_Host] = []
    for k, c in enumerate(spec.components):
      if not c.in_graph:
        continue
      where = f"rewards.components[{k}] ('{c.name}')"
      kind = "judge" if c.judge is not None else "model"
      path = os.path.expanduser(c.judge if kind == "judge" else c.model)
      kw = dict(c.kwargs)
      tok = _tokenizer(path, where)
      graph.check_vocabulary(policy_tokenizer, tok, where)
      model_dtype = kw.get("dtype", dtype)
      if kind == "model":
        config, params = load_reward_model(path, mesh, model_dtype, where)
        labels = params["head"].shape[1]
        label = int(kw.get("label", 0))
        if label >= labels:
          raise ConfigError(f"{where}.kwargs.label={label}: the score head has {labels} label(s).")
        gc = GraphComponent(c.name, kind, config, label=label)
      else:
        config, params = load_judge(path, mesh, model_dtype, where)
        if "scores" in kw:
          items = list(kw["scores"].items())
          gc = GraphComponent(c.name, kind, config, token_ids=graph.token_ids(tok, [t for t, _ in items], where),
                              values=tuple(float(v) for _, v in items))
        else:
          gc = GraphComponent(c.name, kind, config, token_ids=graph.token_ids(tok, kw["yes"], where),
                              no_ids=graph.token_ids(tok, kw["no"], where) if "no" in kw else ())
      pad = tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)
      self._hosts.append(_Host(tok, kind, c.template, kw.get("system"), kw.get("response_prefix", ""), int(pad), where))
      self.components.append(gc)
      self.positions.append(k)
      self.params[c.name] = params

  @property
  def names(self) -> list[str]:
    return [gc.name for gc in self.components]

  def __len__(self) -> int:
    return len(self.components)

  # ---- host: the prompt side -------------------------------------------------------------------

  def prompt_arrays(self, examples: Sequence[Mapping[str, Any]], widths: Mapping[str, tuple[int, int]] | None = None
                    ) -> dict[str, dict[str, np.ndarray]]:
    """{name: pad_pieces(...)} for the examples (one per prompt, or one per row)."""
    out = {}
    for gc, h in zip(self.components, self._hosts):
      pieces = [graph.render_pieces(h.tokenizer, h.kind, h.template, ex, system=h.system,
                                    response_prefix=h.response_prefix, where=h.where) for ex in examples]
      w = (widths or {}).get(gc.name, (None, None))
      out[gc.name] = graph.pad_pieces(pieces, h.pad_id, *w)
    return out

  def inputs(self, examples: Sequence[Mapping[str, Any]], num_prompts: int | None = None) -> dict[str, Any]:
    """The step's reward inputs: {"params": the models' parameters, "prompts": {name: arrays}}.

    examples: this process's examples (one per prompt, in the order of its prompt rows); with a
    mesh the prompt arrays are global arrays of `num_prompts` rows sharded like the prompts (each
    process gives its own rows; widths agree over processes).
    """
    import jax

    from rljax import sharding as shd
    local = self.prompt_arrays(examples)
    if self.mesh is None:
      return {"params": self.params, "prompts": jax.tree.map(jax.numpy.asarray, local)}
    if jax.process_count() > 1:   # one width per array over processes: the widest bucket
      mine = {n: (a["prefix"].shape[1], a["suffix"].shape[1]) for n, a in local.items()}
      widths = {n: tuple(max(w[n][i] for w in shd.allgather_objects(mine)) for i in (0, 1)) for n in mine}
      local = self.prompt_arrays(examples, widths)
    rows = num_prompts or len(examples)
    prompts = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        shd.batch_sharding(self.mesh, x.ndim, rows), x), local)
    return {"params": self.params, "prompts": prompts}

  def input_shardings(self, inputs) -> Any:
    """The shardings of `inputs` (for jit's in_shardings)."""
    import jax
    return jax.tree.map(lambda x: x.sharding, inputs)

  # ---- in the step ------------------------------------------------------------------------------

  def scores(self, inputs, tokens, lengths):
    """[N, K_graph] float32: each component's score of rows tokens [N, T] (lengths [N]); the prompt
    arrays hold one row per prompt (repeated over its N / P completions) or one per row."""
    import jax.numpy as jnp
    n = tokens.shape[0]
    cols = []
    for gc, h in zip(self.components, self._hosts):
      p = inputs["prompts"][gc.name]
      reps = n // p["prefix"].shape[0]
      p = {k: jnp.repeat(v, reps, axis=0) if reps > 1 else v for k, v in p.items()}
      ids, mask, last = graph.assemble(p["prefix"], p["prefix_mask"], tokens, lengths, p["suffix"], p["suffix_len"],
                                       self.stop_ids, h.pad_id)
      cols.append(graph.component_scores(gc, inputs["params"][gc.name], ids, mask, last))
    return jnp.stack(cols, axis=1) if cols else jnp.zeros((n, 0), jnp.float32)


# ---- abstract (rljax plan) ---------------------------------------------------------------------------

TEMPLATE_TOKENS = 64    # the plan's allowance for a model's chat template around the prompt (prefix side)
SUFFIX_TOKENS = 32      # and after the completion (the end of the turn; a judge's question)


def _abstract_params(config, mesh, head_labels: int | None):
  import jax

  from rljax.models.policy import init_params, param_shardings
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  shardings = param_shardings(config, mesh)
  params = {"model": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)}
  if head_labels is not None:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params["head"] = jax.ShapeDtypeStruct((config.hidden_size, head_labels), config.storage_dtype, sharding=replicated)
  return params


def abstract_scorer(spec, mesh, *, dtype: str = "float32") -> GraphScorer | None:
  """A GraphScorer of `spec`'s reward models and judges with abstract parameters (sharded
  ShapeDtypeStructs) read from their config.json alone, for compiling the step without weights
  (`rljax plan`); None when the spec has none. Token ids of a judge's yes/score sets are placeholders
  (the program's size does not depend on them)."""
  from rljax.models.config import ModelConfig
  from rljax.models.io import CONFIG_FILE, _read_json
  components = [(k, c) for k, c in enumerate(spec.components) if c.in_graph]
  if not components:
    return None
  scorer = GraphScorer.__new__(GraphScorer)
  scorer.mesh, scorer.stop_ids = mesh, ()
  scorer.components, scorer.positions, scorer.params, scorer._hosts = [], [], {}, []
  for k, c in components:
    kind = "judge" if c.judge is not None else "model"
    path = os.path.join(os.path.expanduser(c.judge if kind == "judge" else c.model), CONFIG_FILE)
    hf = _read_json(path)
    model_dtype = c.kwargs.get("dtype", dtype)
    config = ModelConfig.from_hf(hf, path).replace(dtype=model_dtype, param_dtype=model_dtype)
    if kind == "model":
      config = config.replace(tie_word_embeddings=True)
      labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 1)
      gc = GraphComponent(c.name, kind, config)
    else:
      labels = None
      n = len(c.kwargs.get("scores") or c.kwargs.get("yes") or [0])
      gc = GraphComponent(c.name, kind, config, token_ids=tuple(range(n)),
                          values=tuple(float(i) for i in range(n)) if "scores" in c.kwargs else (),
                          no_ids=tuple(range(len(c.kwargs.get("no") or []))))
    scorer.components.append(gc)
    scorer.positions.append(k)
    scorer.params[c.name] = _abstract_params(config, mesh, labels)
    scorer._hosts.append(_Host(None, kind, c.template, None, "", 0, f"rewards.components[{k}] ('{c.name}')"))
  return scorer


def abstract_inputs(scorer: GraphScorer, prompts: int, prompt_len: int) -> dict[str, Any]:
  """The step's reward inputs as sharded ShapeDtypeStructs: the models' parameters and prompt
  pieces of `prompts` rows, prompt_len + TEMPLATE_TOKENS wide (suffix SUFFIX_TOKENS)."""
  import jax
  import jax.numpy as jnp

  from rljax import sharding as shd
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=shd.batch_sharding(  # noqa: E731
      scorer.mesh, len(shape), prompts))
  width = prompt_len + TEMPLATE_TOKENS
  piece = {"prefix": sds((prompts, width), jnp.int32), "prefix_mask": sds((prompts, width), jnp.bool_),
           "suffix": sds((prompts, SUFFIX_TOKENS), jnp.int32), "suffix_len": sds((prompts,), jnp.int32)}
  return {"params": scorer.params, "prompts": {name: dict(piece) for name in scorer.names}}

