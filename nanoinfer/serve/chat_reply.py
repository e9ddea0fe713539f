"""How a chat reply's text becomes the assistant message: its reasoning (serve/reasoning.py, with
--reasoning-parser), then its tool calls (structured/tool_calls.py), whole or streamed.

Tool calls, by the request's tool_choice:
- "auto" (the default when tools are given): the model's own tool-call syntax is parsed, Qwen's
  `<tool_call>{json}</tool_call>` (`--tool-call-parser hermes`, the default) or Llama 3's JSON
  (`llama3_json`); the text around them stays the content.
- "required" or a named function: structured outputs made the whole reply the call(s) as JSON.
- "none", or no tools: nothing is parsed.
A reply with calls has finish_reason "tool_calls" (a reply cut off by max_tokens keeps "length").
"""
from dataclasses import dataclass

from nanoinfer.serve.reasoning import StreamingReasoning, split_reasoning
from nanoinfer.structured.tool_calls import (HermesToolCallStream, parse_constrained_tool_calls,
                                             parse_hermes_tool_calls, parse_llama3_json_tool_calls)

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ReplyFormat:
    """reasoning: split <think> ... </think>; tool_choice: "auto", "required", a named-function
    dict, or None (no tool parsing); tool_names: the request's functions; parser: for "auto"."""
    reasoning: bool = False
    tool_choice: object = None
    tool_names: tuple[str, ...] = ()
    parser: str = "hermes"

    @classmethod
    def of(cls, body, reasoning: bool, parser: str) -> "ReplyFormat":
        choice = body.tool_choice
        if not body.tools or choice == "none":
            choice = None
        elif choice is None:
            choice = "auto"
        names = tuple(t.get("function", {}).get("name") for t in body.tools or ())
        return cls(reasoning, choice, names, parser)

    @property
    def constrained(self) -> bool:
        return self.tool_choice is not None and self.tool_choice != "auto"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(AssistantMessage fields, finish_reason) of a whole reply."""
        thought, content = split_reasoning(text) if self.reasoning else (None, text)
        calls, content = self.tool_calls(content, finish_reason)
        fields = dict(content=content, reasoning_content=thought, tool_calls=calls)
        return fields, ("tool_calls" if calls else finish_reason)

    def tool_calls(self, content: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """(the calls in a reply's content, the content left): none unless tools are parsed and the
        reply was not cut off."""
        if self.tool_choice is None or finish_reason == "length":
            return [], content
        if self.constrained:
            try:
                return parse_constrained_tool_calls(content, self.tool_choice), None
            except ValueError:
                return [], content
        parse = parse_llama3_json_tool_calls if self.parser == "llama3_json" else parse_hermes_tool_calls
        parsed = parse(content, self.tool_names)
        return (parsed.tool_calls, parsed.content) if parsed.tool_calls else ([], content)

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


class ReplyStream:
    """One choice's stream: `feed(text, final)` -> (reasoning, content, tool calls) to send now."""

    def __init__(self, fmt: ReplyFormat):
        self.fmt = fmt
        self.reasoning = StreamingReasoning() if fmt.reasoning else None
        self.hermes = HermesToolCallStream(fmt.tool_names) if fmt.tool_choice == "auto" and \
            fmt.parser == "hermes" else None
        self.whole = "" if fmt.tool_choice is not None and self.hermes is None else None  # parsed at the end
        self.num_calls = 0

    def feed(self, text: str, final: bool, finish_reason: str | None) -> tuple[str, str, list[dict]]:
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final)
        calls = []
        if self.hermes is not None:
            text, calls = self.hermes.feed(text)
            if final:
                text += self.hermes.finish()
        elif self.whole is not None:  # constrained or llama3_json: the calls are known at the end
            self.whole += text
            text = ""
            if final:  # (the reasoning is already split off)
                calls, rest = self.fmt.tool_calls(self.whole, finish_reason)
                text = rest or ""
        start, self.num_calls = self.num_calls, self.num_calls + len(calls)
        return thought, text, [dict(call, index=start + i) for i, call in enumerate(calls)]

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0
