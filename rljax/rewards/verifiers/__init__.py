"""Built-in verifiers; importing this package registers them.

  math        final answer (\\boxed{}, "the answer is", last number) equivalent per math-verify
  gsm8k       numeric answer after '####' (or the last number), exact
  arithmetic  final value of an arithmetic expression, exact (Fractions, no eval)
  countdown   expression using the given numbers once each that reaches the target
  format      regex or tag structure (<think>...</think><answer>...</answer>)
  code        Python code run against stdin/stdout or assert tests in a sandbox
  choice      multiple-choice letter
  similarity  normalised string similarity to the reference
  overlong    DAPO soft overlong punishment (token counts)
  majority    group-aware consensus with the other completions of the prompt
  tool_use    per-trajectory tool-call counts and errors (multi-turn tool use)
  remote_judge  a judge model behind an OpenAI-compatible HTTP endpoint (batch kind)
"""
from rljax.rewards.verifiers import (  # noqa: F401
                                     arith,
                                     choice,
                                     code_exec,
                                     fmt,
                                     gsm8k,
                                     majority,
                                     math_answer,
                                     overlong,
                                     remote_judge,
                                     similarity,
                                     tool_use,
)
