"""The OpenAI server's request fields -> StructuredOutputsParams (or None: no constraint).

- `response_format`: {"type": "text"} (none), {"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}};
- vLLM's extra fields: `structured_outputs` (a dict of StructuredOutputsParams fields) and the
  legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- `tools` + `tool_choice`: "required" -> a JSON array of one or more {"name", "parameters"} calls,
  each one of the tools (vLLM's format); a named function {"type": "function", "function":
  {"name"}} -> that function's parameters object; "auto" / "none" -> no constraint (the model's
  own tool-call text is parsed afterwards: tool_calls.py).

Every function raises ValueError naming the field on bad input. At most one source may constrain
a request.
"""
from nanoinfer.structured.params import KINDS, StructuredOutputsParams

LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# StructuredOutputsParams fields a client may send; vLLM's backend options that mean nothing here
# (one backend) are accepted and dropped
_ACCEPTED_NO_OP = {"disable_fallback", "disable_additional_properties", "whitespace_pattern", "backend"}


def from_response_format(response_format) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"response_format.json_schema.name must be a string, got {name!r:.60}")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows it left out: any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object, "
                             f"got {type(schema).__name__}")
        return _params("response_format.json_schema.schema", json=schema)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def from_extra_fields(body: dict) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` dict and legacy `guided_*` fields of a request body."""
    found = []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(so).__name__}")
        known = set(KINDS) | {"disable_any_whitespace"}
        unknown = set(so) - known - _ACCEPTED_NO_OP
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {sorted(unknown)}; "
                             f"allowed: {sorted(known)}")
        found.append(("structured_outputs", {k: v for k, v in so.items() if k in known and v is not None}))
    for legacy, kind in LEGACY_FIELDS.items():
        if body.get(legacy) is not None:
            found.append((legacy, {kind: body[legacy]}))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"only one of {', '.join(name for name, _ in found)} may be set")
    name, fields = found[0]
    return _params(name, **fields)


def tools_schema(tools, tool_choice, parallel_tool_calls: bool | None = None) -> dict | None:
    """The JSON schema that `tool_choice` imposes on the output (None: no constraint);
    parallel_tool_calls=False: "required" makes exactly one call."""
    tools = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("auto", "none"):
        return None
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs a non-empty tools list")
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1,
                  "items": {"type": "object", "anyOf": [_call_schema(f) for f in tools]}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema
    name = named_tool_choice(tool_choice)
    for f in tools:
        if f["name"] == name:
            return _parameters(f)
    raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                     f"({', '.join(f['name'] for f in tools)})")


def from_tools(tools, tool_choice, parallel_tool_calls: bool | None = None) -> StructuredOutputsParams | None:
    """`tools` + `tool_choice` -> the constraint for "required" or a named function, else None."""
    schema = tools_schema(tools, tool_choice, parallel_tool_calls)
    return None if schema is None else _params("tools", json=schema)


def structured_outputs_for_request(body: dict) -> StructuredOutputsParams | None:
    """Everything in a chat / completion request body that constrains the output, combined:
    at most one of response_format (other than text), vLLM's fields, and tool_choice
    "required" / named may constrain it."""
    found = [(name, so) for name, so in (
        ("response_format", from_response_format(body.get("response_format"))),
        ("structured_outputs", from_extra_fields(body)),
        ("tool_choice", from_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))),
    ) if so is not None]
    if len(found) > 1:
        raise ValueError(f"{' and '.join(name for name, _ in found)} cannot both constrain the output")
    return found[0][1] if found else None


def check_tools(tools) -> list[dict]:
    """OpenAI `tools` -> their function dicts ({"name", "description"?, "parameters"?}), checked."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.80}")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise ValueError(f"tools[{i}].function must be an object with a 'name'")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, got {name!r:.60}")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is defined twice")
        names.add(name)
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, "
                             f"got {type(params).__name__}")
        functions.append(f)
    return functions


def named_tool_choice(tool_choice) -> str:
    """The function name of tool_choice {"type": "function", "function": {"name": ...}}."""
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        f = tool_choice.get("function")
        if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]:
            return f["name"]
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r:.80}")


def _parameters(f: dict) -> dict:
    return f.get("parameters") or {"type": "object", "properties": {}}


def _call_schema(f: dict) -> dict:
    return {"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters(f)},
            "required": ["name", "parameters"]}


def _params(field: str, **fields) -> StructuredOutputsParams:
    """StructuredOutputsParams, its errors renamed after the request field they came from."""
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{field}: {e}") from None
