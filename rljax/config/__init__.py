"""The run configuration: one ml_collections ConfigDict, validated before anything heavy starts.

Every recipe under `configs/` starts from `base_config()` and changes fields; the command line
applies gin bindings and `--config.a.b=value` overrides on top. The dict is locked, so a typo in
a field name is an error, not a silently ignored setting.

One module per job:
  schema        every field declared once, with its default and help: `base_config`, `field_help`
  validation    types, ranges and contradictions: `validate`
  derive        settings derived from the config: `loss_config`, `lora_config`, `max_staleness`, ...
  context       the model's context against prompt + completion lengths, read without weights
  help          `describe_fields` (`rljax config show`)
  overrides     `--config.FIELD=VALUE`: `set_field`, `apply_overrides`, splitting the arguments
  gin_bindings  `--gin_file` / `--gin_bindings`: `apply_gin`
  loading       recipe files and the command line's config: `load_config_file`, `resolve_config`
"""
import importlib

# name -> the submodule defining it. Imported on first use (PEP 562), so that `rljax train --help`
# and the argument splitting (`rljax.config.overrides`) do not import jax, grain and the models,
# which the schema, validation and derivation need.
_EXPORTS = {
    "context": ("RANDOM_MODEL_CONTEXT", "check_model_fits", "check_model_fits_early", "model_context_length"),
    "derive": ("DEFAULT_OFF_POLICY_TIS_CAP", "dynamic_oversample", "lora_config", "loss_config", "max_staleness",
               "recompute_old_logprobs"),
    "gin_bindings": ("apply_gin",),
    "help": ("describe_fields",),
    "loading": ("DEFAULT_RECIPE", "build_config", "load_config_file", "resolve_config"),
    "overrides": ("apply_overrides", "parse_value", "set_field", "split_config_args", "split_gin_args"),
    "schema": ("SCHEMA", "Field", "Section", "base_config", "field_help", "flatten", "lock", "to_json"),
    "validation": ("ASYNC_ONLY", "MODEL_DTYPES", "PARTIAL_ONLY", "PROXIMAL", "ROLLOUT_MODES", "TOOL_FORMATS",
                   "validate"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
  if name in _MODULE_OF:
    return getattr(importlib.import_module(f"rljax.config.{_MODULE_OF[name]}"), name)
  raise AttributeError(f"module 'rljax.config' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_MODULE_OF))
