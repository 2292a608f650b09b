"""From request fields to one structured-output constraint.

Four ways to ask, as in vLLM: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` and its older ``guided_*`` fields, and
``tool_choice`` ``required`` or a named function (the arguments are then generated under
the function's parameter schema). At most one may constrain a request: two are a 400
naming both, never one silently winning.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.server.protocol import ChatCompletionRequest, SamplingFields, Tool
from kvpilot.engine.structured_output import StructuredOutputsParams

SO = StructuredOutputsParams


def _schema(value: Any, param: str) -> str:
    return SO.schema_text(value, param)


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint ``req`` asks for through ``response_format``, ``structured_outputs``
    or ``guided_*`` (tool choices: :func:`tool_constraint`), or None.

    Raises:
        InvalidRequestError: two of them at once, or an empty/invalid one; ``param``
            names the field.
    """
    found: list[StructuredOutputsParams] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(SO(json_object=True, param="response_format"))
        else:
            js = rf.json_schema
            if js.schema_ is None:
                found.append(SO(json_object=True, param="response_format"))
            else:
                found.append(SO(json=_schema(js.schema_, "response_format.json_schema.schema"),
                                strict=js.strict is not False, param="response_format"))
    so = req.structured_outputs
    if so is not None:
        found.append(SO(
            json=None if so.json_ is None else _schema(so.json_, "structured_outputs.json"),
            json_object=bool(so.json_object),
            regex=so.regex,
            choice=tuple(so.choice) if so.choice is not None else None,
            grammar=so.grammar,
            any_whitespace=not so.disable_any_whitespace,
            param="structured_outputs",
        ))
    guided = {name: getattr(req, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
              if getattr(req, name) is not None}
    for name, value in guided.items():
        kind = name.removeprefix("guided_")
        if kind == "json":
            found.append(SO(json=_schema(value, name), param=name))
        elif kind == "choice":
            found.append(SO(choice=tuple(value), param=name))
        else:
            found.append(SO(**{kind: value}, param=name))
    if len(found) > 1:
        names = ", ".join(f.param for f in found)
        raise InvalidRequestError(
            f"{names} each constrain the output; give only one of them", found[1].param)
    return found[0] if found else None


def tool_parameters(tool: Tool) -> dict[str, Any]:
    """A tool's parameter schema; a function without ``parameters`` takes no arguments
    (an empty object, as OpenAI reads it). Raises InvalidRequestError when it is not a
    JSON schema of an object."""
    params = tool.function.parameters
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    kind = params.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(
            f"tools: the parameters of function {tool.function.name!r} must be a JSON schema with "
            f"\"type\": \"object\", got type {kind!r}", "tools")
    return params


def tool_constraint(req: ChatCompletionRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint of ``tool_choice`` and what the output then is: ``("named", name)``
    -> the named function's arguments object; ``required`` -> a JSON array of
    ``{"name", "parameters"}`` calls (at least one; one only with
    ``parallel_tool_calls: false``), vLLM's shape. Returns ``(None, None)`` for
    ``auto``/``none``/no tools.

    Raises:
        InvalidRequestError: ``tool_choice`` without ``tools``, an unknown function
            name, or parameters that are not an object schema.
    """
    choice = req.tool_choice
    tools = req.tools or []
    for tool in tools:
        tool_parameters(tool)  # every tool's schema is checked, whatever the choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidRequestError(f"tools: function name {dup!r} appears more than once", "tools")
    if choice is None or choice in ("auto", "none"):
        return None, None
    if not tools:
        raise InvalidRequestError(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools",
                                  "tool_choice")
    if choice == "required":
        items = [{
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": tool_parameters(t)},
            "required": ["name", "parameters"],
        } for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        # A schema xgrammar cannot compile is the tools' fault: the 400 names `tools`.
        return SO(json=_schema(schema, "tools"), param="tools"), "required"
    assert not isinstance(choice, str)
    name = choice.function.name
    forced = next((t for t in tools if t.function.name == name), None)
    if forced is None:
        raise InvalidRequestError(
            f"tool_choice: function {name!r} is not among the tools ({', '.join(names)})", "tool_choice")
    return SO(json=_schema(tool_parameters(forced), "tools"), param="tools"), name
