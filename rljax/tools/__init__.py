"""Tools for multi-turn tool-use RL: the model calls a tool mid-generation, the host runs
it and answers, and decoding resumes.

    from rljax.tools import ToolRunner, parse_tool_call
    with ToolRunner(["calculator", "python"]) as runner:
      tools = runner.schemas()                       # for apply_chat_template(..., tools=tools)
      call = parse_tool_call(turn_text, "hermes")    # None: the turn is a final answer
      [obs] = runner.run([call])                     # obs.text goes back as the tool message

Modules: registry (Tool, register_tool, get_tool), parsing (ToolCall, parse_tool_call),
builtin (calculator, search, python), executor (ToolRunner, Observation).
"""
from rljax.tools.executor import Observation, ToolRunner, execute_tool
from rljax.tools.parsing import FORMATS, ToolCall, end_markers, parse_tool_call
from rljax.tools.registry import Tool, get_tool, list_tools, register_tool, validate_arguments

__all__ = [
    "FORMATS", "Observation", "Tool", "ToolCall", "ToolRunner", "end_markers", "execute_tool", "get_tool",
    "list_tools", "parse_tool_call", "register_tool", "validate_arguments",
]
