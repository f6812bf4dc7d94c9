"""The run config's fields: each declared once with its default and its help text.

`SCHEMA` is the tree of sections and fields; `base_config()` builds the ml_collections
ConfigDict every recipe starts from, and `field_help()` reads the help from the same
declarations (`rljax config show` prints it). The rl section is LossConfig's fields, documented
in LossConfig's docstring (rljax/rl/config.py), plus the preset.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any, Mapping

import ml_collections

from rljax.data.config import SOURCE_KINDS
from rljax.models import families
from rljax.models.config import ATTENTION_IMPLS, MOE_DISPATCH, MOE_KERNELS
from rljax.objectives import OBJECTIVES
from rljax.rl.config import PRESETS, LossConfig
from rljax.trainer import modes
from rljax.trainer.optim import SCHEDULES


@dataclasses.dataclass(frozen=True)
class Field:
  """A config field: its default and what it means. placeholder: an optional field of this type
  whose default is None (ml_collections' placeholder keeps the type for overrides)."""
  default: Any
  help: str
  placeholder: type | None = None


class Section:
  """A group of fields (a ConfigDict); `type_safe=False` lets a field change type (e.g. None -> 0.2)."""

  def __init__(self, help: str, *, type_safe: bool = True, **fields: "Field | Section"):   # noqa: A002
    self.help = help
    self.type_safe = type_safe
    self.fields = fields

  def build(self) -> ml_collections.ConfigDict:
    values = {}
    for name, f in self.fields.items():
      if isinstance(f, Section):
        values[name] = f.build()
      elif f.placeholder is not None:
        values[name] = ml_collections.config_dict.placeholder(f.placeholder)
      else:
        values[name] = copy.deepcopy(f.default)
    return ml_collections.ConfigDict(values, type_safe=self.type_safe)

  def helps(self, prefix: str = "") -> dict[str, str]:
    """{"train.steps": help, "train": the section's help, ...} in declaration order."""
    out = {}
    for name, f in self.fields.items():
      out[prefix + name] = f.help
      if isinstance(f, Section):
        out.update(f.helps(f"{prefix}{name}."))
    return out


def _loss_field_help() -> dict[str, str]:
  """Each LossConfig field's entry in LossConfig's docstring (`    name: text` or `    a, b: text`,
  continued on lines indented two more)."""
  doc, current = {}, None
  for line in (LossConfig.__doc__ or "").splitlines():
    m = re.match(r"^    ([a-z_][a-z_0-9, ]*): (.*)$", line)
    if m:
      current = [n.strip() for n in m.group(1).split(",")]
      for n in current:
        doc[n] = m.group(2).strip()
    elif current and re.match(r"^      \S", line):
      for n in current:
        doc[n] += " " + line.strip()
    else:
      current = None
  return {f.name: (doc.get(f.name, "") + " (None: the preset's value)").strip() for f in dataclasses.fields(LossConfig)}


_TOOL_POOL = "the tool pool (like config.rewards): "

SCHEMA = Section(
    "the run config",
    model=Section(
        "the policy model (docs/models.md)",
        path=Field("smollm2-135m-instruct", 'HF dir, .gguf file, or built-in name; "random" builds model.random'),
        dtype=Field("float32", "compute dtype of activations"),
        remat=Field(False, "recompute layer activations in the backward pass"),
        attention=Field("auto", "learner attention: " + " | ".join(ATTENTION_IMPLS) + " (docs/models.md)"),
        lora=Section(
            'low-rank adapters (README "LoRA"; docs/models.md#lora)', type_safe=False,
            rank=Field(0, "adapter rank; 0 = full fine-tuning. > 0: the base is frozen in model.dtype"),
            alpha=Field(16.0, "the adapter's output is scaled by alpha / rank"),
            dropout=Field(0.0, "dropout on the adapter input, in the learner's loss forward only"),
            targets=Field(["q", "k", "v", "o", "gate", "up", "down"], "projections adapted (attention and MLP)"),
        ),
        moe=Section(
            'mixture-of-experts models only (README "Mixture-of-Experts"; docs/models.md#mixture-of-experts); '
            "setting any of these for a dense model is an error", type_safe=False,
            routing_replay=Field("auto", "routing replay: the sampler records each token's experts in the Rollout "
                                         "and the learner computes with them (gates recomputed, so the router "
                                         "learns): True | False | 'auto' (on unless model.dtype is float32)"),
            aux_loss_coef=Field(None, "load-balancing loss weight (0 = off, the RL default); None: the checkpoint's "
                                      "router_aux_loss_coef when its config.json sets output_router_logits, else 0"),
            z_loss_coef=Field(0.0, "router z-loss weight (0 = off)"),
            kernel=Field("auto", "the experts' grouped matmul: " + " | ".join(MOE_KERNELS) + " (auto = ragged_dot)"),
            dispatch=Field("auto", "tokens to experts split over fsdp: " + " | ".join(MOE_DISPATCH)
                                   + " (auto: all_to_all when fsdp > experts per token, else gather)"),
        ),
        random=Section(
            'used when path == "random" (tests, smoke runs)',
            vocab_size=Field(0, "vocabulary size; 0 = the tokenizer's (config.tokenizer)"),
            hidden_size=Field(64, "width of the residual stream"),
            intermediate_size=Field(128, "width of the MLP"),
            num_layers=Field(2, "decoder layers"),
            num_heads=Field(4, "query heads"),
            num_kv_heads=Field(2, "key/value heads (grouped-query attention when fewer than num_heads)"),
            head_dim=Field(16, "dimension of each attention head"),
            architecture=Field("llama", "model family: " + " | ".join(families.names())),
            tie_word_embeddings=Field(True, "the output projection is the embedding matrix"),
            seed=Field(0, "seed of the random initialisation"),
        ),
    ),
    tokenizer=Field("", "defaults to model.path"),
    data=Section(
        "the data pipeline's fields: see docs/data.md", type_safe=False,
        sources=Field([dict(kind="arithmetic", weight=1.0, verifier="arithmetic", difficulty=1)],
                      "the prompt sources, each a dict: kind (" + " | ".join(SOURCE_KINDS) + "), path, weight, "
                      "verifier (what a 'by_source' reward component scores its rows with; 'none': none), ... "
                      "(docs/data.md)"),
        system_prompt=Field("", "system message put before every prompt (\"\" = none)"),
        prompt_template=Field("{prompt}", "the user message; {prompt} is the example's prompt"),
        max_prompt_tokens=Field(128, "prompts longer than this (in tokens, after the chat template) are filtered out"),
        on_malformed=Field("skip", "an example the source cannot parse: skip (and count it) or raise"),
        max_line_bytes=Field(16 << 20, "a JSONL line longer than this (bytes) is a malformed row, never read "
                                       "into memory"),
        shuffle=Field(True, "shuffle the examples (each epoch)"),
        seed=Field(0, "seed of the shuffle and of procedural sources"),
        num_epochs=Field(None, "passes over the data before the run stops; None cycles forever"),
        chat_template=Field(True, "format prompts with the tokenizer's chat template"),
    ),
    sampling=Section(
        "how completions are sampled (docs/sampling.md)", type_safe=False,
        num_samples=Field(8, "G: completions per prompt"),
        max_new_tokens=Field(128, "completion length limit T (tokens)"),
        temperature=Field(1.0, "softmax temperature; 0 = greedy"),
        top_k=Field(0, "keep the k most likely tokens (0 = off)"),
        top_p=Field(1.0, "nucleus sampling: keep the most likely tokens up to this probability mass (1 = off)"),
        min_p=Field(0.0, "drop tokens less likely than min_p times the most likely one (0 = off)"),
        ignore_eos=Field(False, "generate max_new_tokens in every row (benchmarks; vLLM's ignore_eos)"),
        stop_token_ids=Field([], "extra ids that end a completion, besides the tokenizer's stop tokens"),
        slots=Field(0, "decode slots (continuous batching): 0 = one per row (prompts x num_samples); fewer: rows "
                       "decode that many at a time, a finished row's slot taking the next one. Same samples; "
                       "per-step compute and completion KV cache scale with slots. Lower it when lengths have a "
                       "long tail (docs/sampling.md)"),
    ),
    rl=Section(
        "the loss: a preset plus every LossConfig field; None keeps the preset's value (docs/loss.md)",
        type_safe=False,
        preset=Field("grpo", "the loss recipe: " + ", ".join(sorted(PRESETS)) + " (docs/loss.md)"),
        **{name: Field(None, text) for name, text in _loss_field_help().items()},
    ),
    rewards=Section(
        "the reward components and the pool that scores them (docs/rewards.md)", type_safe=False,
        components=Field([dict(name="correct", verifier="by_source", weight=1.0)],
                         "weighted reward components, each a dict: name, verifier ('by_source': the verifier its "
                         "data source names) or model (a reward model dir) or judge (a causal LM dir, with "
                         "template), weight, sources, ... (docs/rewards.md)"),
        timeout_s=Field(5.0, "seconds one verifier call may take; then it scores `fallback`"),
        batch_deadline_s=Field(120.0, "seconds a whole batch may take to score"),
        fallback=Field(0.0, "the reward of a verifier call that timed out or failed"),
        num_workers=Field(2, "verifier worker processes"),
        max_memory_mb=Field(2048, "memory limit of each worker process"),
        sandbox=Section(
            "how model-written code is isolated (docs/rewards.md)", type_safe=False,
            require_isolation=Field(False, "True: refuse to run model code unisolated (docs/rewards.md)"),
        ),
    ),
    optim=Section(
        "the optimizer: AdamW with global-norm clipping and a warmup + decay schedule",
        learning_rate=Field(1e-6, "peak learning rate"),
        schedule=Field("constant", "after warmup: " + " | ".join(SCHEDULES) + " (decay to min_lr_ratio * peak)"),
        warmup_steps=Field(0, "optimizer updates of linear warmup from 0"),
        min_lr_ratio=Field(0.0, "the decayed schedule's floor, as a fraction of the peak"),
        weight_decay=Field(0.0, "AdamW's decoupled weight decay"),
        b1=Field(0.9, "AdamW's first-moment decay"),
        b2=Field(0.999, "AdamW's second-moment decay"),
        eps=Field(1e-8, "AdamW's epsilon"),
        max_grad_norm=Field(1.0, "clip gradients to this global norm (None: no clipping)"),
        max_consecutive_skips=Field(5, "stop the run after this many non-finite updates in a row"),
    ),
    train=Section(
        "the step's shape and length of the run",
        objective=Field("rl", " | ".join(OBJECTIVES) + ": the policy-gradient update (rl), supervised cross-entropy on "
                        "the data's target responses (sft), cross-entropy on sampled completions whose reward reaches "
                        "rft.min_reward (rft), on-policy distillation from distill.teacher (distill) "
                        '(README "Beyond RL")'),
        steps=Field(10, "rollout steps (each: sample, score, 1+ optimizer updates)"),
        prompts_per_step=Field(8, "prompts sampled per step; completions = prompts * num_samples"),
        mini_batches=Field(1, "optimizer updates per rollout batch per epoch"),
        epochs=Field(1, "passes over each rollout batch"),
        micro_batches=Field(1, "gradient accumulation: splits each mini-batch (by whole groups)"),
        pack_tokens=Field(0, "> 0: packed update: blocks of this many real tokens (trainer/packing.py)"),
        pack_width=Field(0, "with pack_tokens: the packed bins' width in tokens (0 = one row's, max_prompt_tokens "
                         "+ max_new_tokens); wider bins fill better and, with shared_prefix, let one prompt copy "
                         "serve more completions, at attention cost growing with the width"),
        shared_prefix=Field(False, "the update computes each prompt once per chunk of its group's completions "
                            "instead of once per completion (same loss; trainer/packing.py)"),
        seed=Field(0, "seed of the sampling keys, the LoRA adapters' initialisation and dropout"),
        dynamic_sampling=Field(False, "DAPO: drop zero-variance groups, refill from oversampled prompts"),
        oversample=Field(None, "with dynamic_sampling: prompts sampled = prompts_per_step * oversample (default 2); "
                         "refused without it", placeholder=int),
        stop_signals=Field(["SIGINT", "SIGTERM"], "signals that stop the run after the step in progress, with a "
                           "checkpoint (a second one exits at once); [] = die at once, the default behaviour"),
        process_deadline_s=Field(1800.0, "multi-process runs: seconds a process waits at the end of a step for the "
                                 "others before stopping with an error that names the missing ones (0: forever)"),
    ),
    sft=Section(
        "train.objective='sft': supervised fine-tuning on target responses (README \"Beyond RL\")",
        response_template=Field("{response}", "the target text of a row: {response} is the source's response field "
                                "(data.sources[i].fields.response, default 'response'), {answer} its reference "
                                "answer (procedural sources have no response: e.g. '{answer}'), or any fields.extra "
                                "name. Rows with chat messages (fields.messages) train on their assistant turns "
                                "instead. Targets longer than sampling.max_new_tokens tokens are skipped and counted"),
    ),
    rft=Section(
        "train.objective='rft': rejection-sampling fine-tuning (expert iteration)",
        min_reward=Field(1.0, "sampled rows whose reward is at least this are kept and trained on by cross-entropy; "
                              "the rest get no gradient (rft/kept_fraction counts them)"),
    ),
    distill=Section(
        "train.objective='distill': on-policy distillation (the student samples, the teacher scores every token)",
        teacher=Field("", "the teacher: any model rljax loads (HF dir, .gguf, built-in name) with the student's "
                          "vocabulary; frozen, sharded like the reference model, never optimised"),
        reward_weight=Field(0.0, "adds reward_weight * the group advantage of the verifier rewards (rl.* scopes) to "
                                 "the per-token advantage -(log p_student - log p_teacher); 0 = pure distillation"),
    ),
    rollout=Section(
        "How generation, scoring and updates are scheduled (docs/rollouts.md).",
        mode=Field("fused", " | ".join(modes.MODES) + " (docs/rollouts.md)"),
        max_staleness=Field(-1, "policy versions a sample may lag; -1 = the mode's default (1)"),
        proximal=Field("recompute", "off-policy lp_old: recompute (decoupled PPO) | sampler (PPO on behaviour)"),
        generator_devices=Field(0, "async: devices of the generator part of the mesh (0 = half)"),
        generator_mesh=Field((-1, 1, 1), "async: the generators' (data, fsdp, tensor) axis sizes over "
                                         "generator_devices; -1 takes the rest. Their decode layout is chosen "
                                         "on it (tensor > 1 splits the weights; a model too large to replicate "
                                         "folds data into tensor by itself)"),
        sync_every=Field(1, "async: publish parameters to the generators every N updates"),
        queue_size=Field(2, "async: scored batches waiting for the learner"),
        oversample=Field(2, "partial: prompt groups in generation per group trained"),
    ),
    tools=Section(
        "Multi-turn tool use (docs/tools.md): the model calls tools mid-generation, the host answers.",
        type_safe=False,
        enabled=Field(False, "turn multi-turn tool use on (rollout.mode='pipelined')"),
        names=Field(["python"], 'tool refs: python, calculator, search, or "pkg.module:function"'),
        format=Field("hermes", "hermes (<tool_call>{json}</tool_call>) | python (```python blocks)"),
        max_turns=Field(4, "tool calls per trajectory"),
        segment_tokens=Field(64, "decode steps per compiled segment"),
        slots=Field(0, "KV-cache slots after the prompt (0 = 2 * sampling.max_new_tokens)"),
        max_response_tokens=Field(256, "tool-response tokens kept per call"),
        timeout_s=Field(10.0, _TOOL_POOL + "seconds one tool call may take"),
        num_workers=Field(2, _TOOL_POOL + "worker processes"),
        max_memory_mb=Field(2048, _TOOL_POOL + "memory limit of each worker process"),
        kwargs=Field({}, 'per-tool keyword arguments, e.g. {"search": {"corpus_path": "docs.jsonl"}}'),
    ),
    mesh=Section(
        "the device mesh (docs/models.md)",
        shape=Field((-1, 1, 1), "(data, fsdp, tensor) axis sizes; -1 takes the remaining devices"),
        distributed=Field(False, "initialise jax.distributed (multi-process runs)"),
    ),
    compile=Section(
        "compilation",
        cache_dir=Field("", 'jax\'s persistent compilation cache: programs kept across runs ("" = off)'),
    ),
    checkpoint=Section(
        "checkpoints (docs/checkpoints.md)",
        every=Field(0, "save every N steps (0: only at the end)"),
        keep_last=Field(2, "the most recent checkpoints kept"),
        keep_best=Field(1, "the best checkpoints kept, by best_metric"),
        best_metric=Field("eval/accuracy", "the metric that ranks checkpoints (higher is better)"),
        async_save=Field(True, "write checkpoints in the background"),
        resume=Field(True, "resume from output.dir's latest checkpoint (False: start over, as --overwrite)"),
    ),
    eval=Section(
        "held-out evaluation on the data's test split",
        every=Field(0, "evaluate every N steps (0: never during training)"),
        num_examples=Field(64, "test examples evaluated"),
        samples=Field(1, "completions per example (mean@k, pass@k)"),
        temperature=Field(0.0, "sampling temperature of evaluation; 0 = greedy"),
        max_new_tokens=Field(0, "completion length limit (0 = sampling.max_new_tokens)"),
        before_and_after=Field(True, "evaluate before the first step and after the last"),
        allow_training_data=Field(False, "evaluate even where the test split reads the training file (on purpose)"),
        batch_size=Field(0, "completions decoded at once (0 = a training step's rows, at least 128); greedy results "
                         "do not depend on it"),
        shared_prefix=Field(True, "prefill the leading tokens every prompt of a batch shares (a system prompt, "
                            "few-shot examples) once per batch, not once per prompt; same completions up to "
                            "float32 reordering"),
    ),
    output=Section(
        "what the run writes into output.dir",
        dir=Field("runs/default", "the run directory: config, checkpoints, metrics, evaluations, export"),
        export_hf=Field(True, "export the trained model as a Hugging Face directory (<dir>/hf) at the end"),
        export_dtype=Field("bfloat16", "dtype of the exported weights"),
        tensorboard=Field(True, "write TensorBoard event files (<dir>/tb)"),
        progress=Field(True, "show progress bars"),
        wandb=Section(
            "Weights & Biases logging beside metrics.jsonl and TensorBoard (optional: pip install wandb)",
            project=Field("", 'the W&B project to log to ("" = off)'),
            name=Field("", 'the run\'s name in W&B ("" = the output.dir name)'),
            entity=Field("", 'the W&B team or user ("" = your default)'),
            mode=Field("online", "online | offline (logs under <dir>/wandb; `wandb sync` uploads them later)"),
        ),
    ),
)


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by every recipe (the embedded default changes a few)."""
  return SCHEMA.build()


def lock(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  c.lock()
  return c


def to_json(c: ml_collections.ConfigDict) -> str:
  return json.dumps(c.to_dict(), indent=2, sort_keys=True, default=str)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"train.steps": 10, ...}: a nested mapping's leaves by dotted name; lists (data.sources,
  mesh.shape, rollout.generator_mesh) and empty mappings (tools.kwargs) stay whole values."""
  if isinstance(tree, Mapping) and (tree or not prefix):
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def field_help() -> dict[str, str]:
  """{"train.steps": "rollout steps (...)", "model": "<the section's help>", ...}: every field's and
  section's declared help."""
  return SCHEMA.helps()
