"""Reasoning output (`--reasoning-parser qwen3`): a reply that starts with <think> has its text up
to </think> returned as `reasoning_content`, the rest as `content` (vLLM's field names); a reply
cut off before </think> is all reasoning. A reply holding </think> without the opening tag (the
template opened the thinking) is split at </think> too, when the whole reply is seen at once."""

PARSERS = ("qwen3", "deepseek_r1")  # both write <think> ... </think>
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole reply."""
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START)
    body = stripped[len(THINK_START):] if opened else text
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end].strip("\n"), body[end + len(THINK_END):].lstrip("\n")
    if opened:
        return body.lstrip("\n"), ""
    return None, text


class StreamingReasoning:
    """The same split over a stream of text deltas: `feed` each delta, get its (reasoning, content)
    pieces. Text that may be the start of a tag is held back until the next delta (or the end)."""

    def __init__(self):
        self.state = "undecided"  # -> "thinking" (the reply opened with <think>) -> "content"
        self.held = ""
        self.strip_newline = False  # the newline after a tag is not part of the text

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.state == "undecided":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self.state, text, self.strip_newline = "thinking", stripped[len(THINK_START):], True
            elif THINK_START.startswith(stripped) and not final:
                self.held = text  # (empty, whitespace or a partial tag: wait)
                return "", ""
            else:
                self.state = "content"
        if self.strip_newline:
            text = text.lstrip("\n")
            self.strip_newline = not text
        if self.state == "thinking":
            end = text.find(THINK_END)
            if end >= 0:
                reasoning, text = text[:end], text[end + len(THINK_END):]
                text = text.lstrip("\n")
                self.state, self.strip_newline = "content", not text
            else:
                keep = 0 if final else _partial_suffix(text, THINK_END)
                if keep:
                    self.held, text = text[-keep:], text[:-keep]
                return text, ""
        return reasoning, text if self.state == "content" else ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
