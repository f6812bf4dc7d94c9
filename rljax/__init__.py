"""rljax: a JAX-native trainer for reinforcement learning with verifiable rewards.

Public API (imported lazily so `import rljax` stays cheap):
  load_pretrained, save_pretrained, load_tokenizer, generate, SamplingParams, Policy, ModelConfig.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Policy": "rljax.models.policy",
    "ModelConfig": "rljax.models.config",
    "init_params": "rljax.models.policy",
    "load_pretrained": "rljax.models.io",
    "save_pretrained": "rljax.models.io",
    "load_tokenizer": "rljax.tokenizer",
    "generate": "rljax.rollout",
    "SamplingParams": "rljax.rollout",
}


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'rljax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_EXPORTS))
