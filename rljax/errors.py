"""Exceptions raised by rljax. Every message names the problem and the fix."""


class RljaxError(Exception):
  """Base class of every error rljax raises on purpose."""


class ConfigError(RljaxError, ValueError):
  """A configuration field is unknown, has the wrong type, or contradicts another."""


class WeightsError(RljaxError, ValueError):
  """A weights file is missing, corrupt, or does not match the model config."""


class TokenizerError(RljaxError, ValueError):
  """A tokenizer file is missing, corrupt, or unsupported."""


class DataError(RljaxError, ValueError):
  """A dataset file or row is missing or malformed."""
