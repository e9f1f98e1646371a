"""Tool calling for chat completions (``tools`` / ``tool_choice``, issue #31).

Decisions:

* The tools go to the chat template as ``tools`` (the variable HF templates that support tools read);
  earlier assistant ``tool_calls`` and ``tool`` messages go to it as the client sent them.
* ``tool_choice`` "required" or a named function constrains the output with a grammar (structured
  output, :mod:`zerospeed.inference.constraints`): a named function's ``arguments`` object (its
  ``parameters`` schema), or for "required" one ``{"name", "arguments"}`` object for any of the
  tools. The call therefore always parses and names a tool that exists.
* ``tool_choice`` "auto" (the default with tools) generates freely and then looks for calls in the
  text in the two layouts chat templates teach models: ``<tool_call>{"name": .., "arguments": ..}
  </tool_call>`` blocks (Hermes, Qwen) or a whole reply that is one such JSON object (Llama 3.1's
  ``parameters`` spelling too). What is not a call stays ``content``. "none" passes no tools.
* A reply with calls has ``finish_reason`` "tool_calls" and ``content`` None (OpenAI's shape). With
  tools, a streamed reply is sent when complete (its calls cannot be told from text before), as
  one delta with the role, the content or the calls, then the finish chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from zerospeed.inference.serving.protocol import ApiError, bad_request

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolPlan:
    """What one chat request does with its tools."""

    tools: list[dict[str, Any]]  # for the template ([] with "none")
    names: list[str]
    mode: str  # "none", "auto", "required", "named"
    named: str | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice``; a 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", "needs tools")
        return ToolPlan([], [], "none")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}]", "must be {'type': 'function', 'function': {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name", "must be a non-empty string")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters", "must be a JSON schema object")
        names.append(name)
    if tool_choice in (None, "auto"):
        return ToolPlan(tools, names, "auto")
    if tool_choice == "none":
        return ToolPlan([], names, "none")
    if tool_choice == "required":
        return ToolPlan(tools, names, "required")
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise bad_request("tool_choice.function.name", f"{name!r} is not one of the tools "
                              f"({', '.join(names)})")
        return ToolPlan(tools, names, "named", name)
    raise bad_request("tool_choice", "must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def call_schema(plan: ToolPlan) -> dict[str, Any] | None:
    """The JSON schema the output must follow, None when free ("auto")."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.named)
        return _parameters(tool)
    if plan.mode == "required":
        return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": t["function"]["name"]},
                                          "arguments": _parameters(t)}}
                          for t in plan.tools]}
    return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _as_call(obj: Any, names: list[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args)


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply."""
    if plan.mode == "named":
        return None, [_call(plan.named, text)]  # the grammar made it the arguments object
    if plan.mode == "required":
        try:
            call = _as_call(json.loads(text), plan.names)
        except json.JSONDecodeError:
            call = None  # cut short by max_tokens: no call to report
        return (None, [call]) if call else (text, [])
    if plan.mode != "auto":
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            call = _as_call(json.loads(block), plan.names)
        except json.JSONDecodeError:
            call = None
        if call:
            calls.append(call)
    if calls:
        rest = _BLOCK.sub("", text).strip()
        return (rest or None), calls
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            call = _as_call(json.loads(stripped), plan.names)
        except json.JSONDecodeError:
            call = None
        if call:
            return None, [call]
    return text, []


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Tool messages need a ``tool_call_id``; assistant ``tool_calls`` must be a list."""
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and not m.get("tool_call_id"):
            raise bad_request(f"messages[{i}].tool_call_id", "is required for a tool message")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls: must be a list",
                           param=f"messages[{i}].tool_calls")
