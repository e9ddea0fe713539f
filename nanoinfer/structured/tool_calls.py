"""A model's tool-call text -> OpenAI `tool_calls`.

- `parse_hermes_tool_calls`: tool_choice "auto" with Hermes / Qwen2.5 / Qwen3 chat templates, which
  emit `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks. Each well-formed
  block becomes a call; the text outside the blocks (and any malformed block, verbatim) stays the
  content. An unclosed block at the end (a stream cut at max_tokens) stays content too.
- `parse_llama3_json_tool_calls`: Llama 3.1 / 3.2 JSON tool calling: the whole output is one or
  more `{"name": ..., "parameters": {...}}` objects separated by `;` (optionally after
  `<|python_tag|>`); anything else is content.
- `parse_constrained_tool_calls`: tool_choice "required" or a named function, where structured
  outputs made the output itself JSON in vLLM's format (structured/openai.py): a list of
  {"name", "parameters"} for "required", the arguments object for a named function.
- `HermesToolCallStream`: the streaming side. Text is handed on as content until a `<tool_call>`
  may be starting; a block is held back until it closes, then it is a call (or, malformed, content).

A call is {"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments"}}, the
arguments a JSON string, as OpenAI returns them.
"""
import json
import re
import secrets
from dataclasses import dataclass, field

from nanoinfer.structured.openai import named_tool_choice

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def make_tool_call(name: str, arguments) -> dict:
    """One OpenAI tool call; `arguments` a dict (dumped to JSON) or already a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_from_block(body: str, tool_names=None) -> dict | None:
    """A block's {"name", "arguments"} JSON -> a call, or None when it is not one (bad JSON, no
    name, arguments not an object, or a name that is not among `tool_names`)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    return make_tool_call(obj["name"], args)


@dataclass
class ParsedToolCalls:
    """content: the text left (None when only calls remain); tool_calls: the calls, in order."""
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def parse_hermes_tool_calls(text: str, tool_names=None) -> ParsedToolCalls:
    """`<tool_call>{json}</tool_call>` blocks in `text` -> calls, and the remaining content.
    `tool_names`: when given, a block naming another function stays content."""
    calls, content, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call_from_block(m.group(1).strip(), tool_names)
        if call is None:
            continue  # malformed: left in the content as written
        calls.append(call)
        content.append(text[pos:m.start()])
        pos = m.end()
    content.append(text[pos:])
    if not calls:
        return ParsedToolCalls(text)
    rest = "".join(content).strip()
    return ParsedToolCalls(rest if rest else None, calls)


LLAMA3_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json_tool_calls(text: str, tool_names=None) -> ParsedToolCalls:
    """Llama 3's JSON calls (the whole output) -> calls; any other output stays content."""
    body = text.strip()
    if body.startswith(LLAMA3_PYTHON_TAG):
        body = body[len(LLAMA3_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return ParsedToolCalls(text)
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except ValueError:
            return ParsedToolCalls(text)
        call = _call_from_block(body[pos:end], tool_names)
        if call is None:
            return ParsedToolCalls(text)
        calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return ParsedToolCalls(None, calls)


def parse_constrained_tool_calls(text: str, tool_choice) -> list[dict]:
    """The output of a request constrained by tool_choice "required" (a JSON list of {"name",
    "parameters"}) or a named function (its arguments object) -> calls. A ValueError when the
    text is not that (a generation cut at max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the constrained tool-call output is not complete JSON: {e}") from None
    if tool_choice == "required":
        if not isinstance(obj, list) or not obj:
            raise ValueError("tool_choice='required' output must be a non-empty JSON list of calls")
        calls = []
        for item in obj:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ValueError(f"a tool call must be {{'name', 'parameters'}}, got {item!r:.80}")
            calls.append(make_tool_call(item["name"], item.get("parameters", {})))
        return calls

    name = named_tool_choice(tool_choice)
    if not isinstance(obj, dict):
        raise ValueError(f"the arguments of {name!r} must be a JSON object, got {text!r:.80}")
    return [make_tool_call(name, obj)]


class HermesToolCallStream:
    """Incremental parse_hermes_tool_calls: `feed(delta)` returns (content to send now, calls
    completed now); `finish()` returns what is left (an unclosed block goes out as content).
    Content that might be the start of `<tool_call>` is held until it is known not to be."""

    def __init__(self, tool_names=None):
        self.tool_names = tool_names
        self.buffer = ""
        self.calls: list[dict] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        out, calls = [], []
        while True:
            start = self.buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_suffix(self.buffer, TOOL_CALL_START)
                out.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(TOOL_CALL_END, start)
            if end < 0:  # inside a block: hold it until it closes
                out.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            block_end = end + len(TOOL_CALL_END)
            call = _call_from_block(self.buffer[start + len(TOOL_CALL_START):end].strip(), self.tool_names)
            out.append(self.buffer[:start])
            if call is None:
                out.append(self.buffer[start:block_end])
            else:
                calls.append(call)
            self.buffer = self.buffer[block_end:]
        self.calls += calls
        return "".join(out), calls

    def finish(self) -> str:
        """The text still held (an unclosed block, or a partial `<tool_call` prefix)."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
