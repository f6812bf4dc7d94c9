"""`rljax config show`: every field of a config with its value, its default and its help."""
from __future__ import annotations

import json

import ml_collections

from rljax.config.schema import base_config, field_help, flatten


def describe_fields(c: ml_collections.ConfigDict) -> str:
  """Every field of `c` as `name = value  # help`, sections in order; a value that differs from
  base_config()'s default shows that default."""
  helps = field_help()
  as_json = lambda cfg: json.loads(json.dumps(cfg.to_dict(), default=str))   # base_config()'s field order
  values = flatten(as_json(c))
  defaults = flatten(as_json(base_config()))
  lines, section = [], None
  for name, value in values.items():
    top = name.split(".")[0] if "." in name else ""
    if top != section:
      section = top
      head = helps.get(top, "") if top else "top-level fields"
      lines.append(f"\n[{top or 'config'}]" + (f"  # {head}" if head else ""))
    text = f"{name} = {json.dumps(value, default=str)}"
    if name in defaults and defaults[name] != value:
      text += f"   (default {json.dumps(defaults[name], default=str)})"
    help_text = helps.get(name) or helps.get(name.rsplit(".", 1)[0] if name.count(".") > 1 else "", "")
    lines.append(f"{text:<60}  # {help_text}" if help_text else text)
  return "\n".join(lines).lstrip("\n") + "\n"
