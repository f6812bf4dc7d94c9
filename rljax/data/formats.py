"""From a raw row to an Example: field mapping, answer extraction, prompt messages.

Answer formats:
  raw    the answer field is the reference answer as-is (numbers become strings);
  gsm8k  GSM8K layout: the text after the last `####`, with thousands commas removed;
  boxed  MATH layout: the content of the last `\\boxed{...}` (or `\\fbox{...}`).
The full answer text of the gsm8k and boxed formats is kept as `solution`.
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.data.sources import RowError

Example = dict  # {"id", "source", "verifier", "split", "prompt", "prompt_messages", "answer", **extras}


def extract_gsm8k_answer(text: str) -> str:
  """The final answer of a GSM8K solution: what follows the last `####`."""
  if "####" not in text:
    raise RowError("answer has no '####' final-answer marker (GSM8K layout)")
  answer = text.rsplit("####", 1)[1].strip().replace(",", "")
  if not answer:
    raise RowError("answer is empty after the '####' marker")
  return answer


def extract_boxed(text: str) -> str:
  """The content of the last `\\boxed{...}` / `\\fbox{...}` in `text` (MATH layout).

  Braces are matched, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. The
  brace-less form `\\boxed 5` gives `5`.
  """
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    raise RowError("solution has no \\boxed{...} answer (MATH layout)")
  i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
  if i < len(text) and text[i] == " ":
    rest = text[i + 1:]
    answer = rest.split("$", 1)[0].split(None, 1)[0] if rest.strip() else ""
    if not answer:
      raise RowError("solution has an empty \\boxed answer")
    return answer
  if i >= len(text) or text[i] != "{":
    raise RowError("solution's \\boxed is not followed by '{'")
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        answer = text[i + 1:j].strip()
        if not answer:
          raise RowError("solution has an empty \\boxed{} answer")
        return answer
  raise RowError("solution's last \\boxed{ has unbalanced braces")


def _answer_text(value: Any, column: str) -> str:
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise RowError(f"answer field '{column}' is {type(value).__name__}, expected a string or number")
  text = value if isinstance(value, str) else str(value)
  if not text.strip():
    raise RowError(f"answer field '{column}' is empty")
  return text


def build_messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
  messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
  messages.append({"role": "user", "content": prompt})
  return messages


def _messages(row: Mapping[str, Any], column: str) -> list[dict[str, str]]:
  """The chat messages of a row's `column`: [{role, content}, ...] with a user turn before any assistant turn."""
  value = row.get(column)
  if not isinstance(value, list) or not value:
    raise RowError(f"messages field '{column}' is {'missing' if value is None else type(value).__name__}, expected a "
                   "non-empty list of {role, content} messages")
  out = []
  for i, m in enumerate(value):
    if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant", "tool") or \
        not isinstance(m.get("content"), str):
      raise RowError(f"messages field '{column}'[{i}] is not a {{role: system|user|assistant|tool, content: str}} "
                     "message")
    out.append({"role": m["role"], "content": m["content"]})
  roles = [m["role"] for m in out]
  first_assistant = roles.index("assistant") if "assistant" in roles else len(roles)
  if "user" not in roles[:first_assistant]:
    raise RowError(f"messages field '{column}' has no user turn before its first assistant turn")
  return out


def row_to_example(row: Mapping[str, Any], src: Mapping[str, Any], top: Mapping[str, Any], *,
                   row_index: int, split: str) -> Example:
  """Maps one raw row to an Example using the source's normalized config.

  Raises:
    RowError: the row lacks a mapped field or its answer cannot be extracted.
  """
  fields = src["fields"]
  conversation = None
  if fields.get("messages"):
    conversation = _messages(row, fields["messages"])
    question = next(m["content"] for m in conversation if m["role"] == "user")
  else:
    column = fields["prompt"]
    if column not in row or row[column] is None:
      raise RowError(f"missing prompt field '{column}' (row has {sorted(row)})")
    question = row[column]
    if not isinstance(question, str) or not question.strip():
      raise RowError(f"prompt field '{column}' is not a non-empty string")

  answer, solution = None, None
  if fields["answer"] is not None:
    column = fields["answer"]
    if column not in row or row[column] is None:
      raise RowError(f"missing answer field '{column}' (row has {sorted(row)})")
    answer = _answer_text(row[column], column)
    if src["answer_format"] == "gsm8k":
      solution, answer = answer, extract_gsm8k_answer(answer)
    elif src["answer_format"] == "boxed":
      solution, answer = answer, extract_boxed(answer)
    else:
      answer = answer.strip()

  extras = {}
  for key, column in fields["extra"].items():
    if column not in row:
      raise RowError(f"missing extra field '{column}' (row has {sorted(row)})")
    extras[key] = row[column]

  if fields["id"] is not None:
    if row.get(fields["id"]) is None:
      raise RowError(f"missing id field '{fields['id']}'")
    example_id = str(row[fields["id"]])
  else:
    example_id = f"{src['label']}:{split}:{row_index}"

  template = src["prompt_template"] if src["prompt_template"] is not None else top["prompt_template"]
  system_prompt = src["system_prompt"] if src["system_prompt"] is not None else top["system_prompt"]
  if conversation is None:
    prompt = template.format_map({**extras, "prompt": question})
    prompt_messages = build_messages(prompt, system_prompt)
  else:   # the turns before the first assistant turn, as written (the system prompt first if they have none)
    prompt = question
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), len(conversation))
    prompt_messages = conversation[:first]
    if system_prompt and prompt_messages[0]["role"] != "system":
      prompt_messages = build_messages("", system_prompt)[:1] + prompt_messages
  example = {
      "id": example_id,
      "source": src["label"],
      "verifier": src["verifier"],
      "split": split,
      "prompt": prompt,
      "prompt_messages": prompt_messages,
      "answer": answer,
  }
  if conversation is not None:
    example["messages"] = prompt_messages + conversation[first:]   # the whole conversation (sft's targets)
  response = row.get(fields.get("response") or "response")
  if isinstance(response, str):
    example["response"] = response
  if solution is not None and "solution" not in extras:
    example["solution"] = solution
  example.update(extras)
  return example
