"""--reasoning-parser: <think> ... </think> becomes reasoning_content, whole replies and streams
alike (a stream split anywhere gives the same two texts)."""
import asyncio
import random

import pytest

pytest.importorskip("fastapi")  # (the server's dependencies; a bare GPU machine may lack them)

from nanoinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from nanoinfer.serve import convert  # noqa: E402
from nanoinfer.serve.chat_reply import ReplyFormat
from nanoinfer.serve.reasoning import StreamingReasoning, split_reasoning

CASES = [
    ("<think>\nabc\n</think>\n\nhello", ("abc", "hello")),
    ("hello world", (None, "hello world")),
    ("<think>cut off", ("cut off", "")),
    ("  <think>\nx</think>y", ("x", "y")),
    ("", (None, "")),
    ("<thi", (None, "<thi")),
    ("<think>\n\n</think>\n\nanswer", ("", "answer")),
    ("<think>a</thinkb</think>c", ("a</thinkb", "c")),
    ("the template opened it</think>\n\nanswer", ("the template opened it", "answer")),
]


@pytest.mark.parametrize("text, want", CASES)
def test_split(text, want):
    assert split_reasoning(text) == want


@pytest.mark.parametrize("text, want", [c for c in CASES if not c[0].startswith("the template")])
def test_stream_split_anywhere_matches(text, want):
    rng = random.Random(text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s, thought, content = StreamingReasoning(), "", ""
        for i, part in enumerate(parts):
            a, b = s.feed(part, final=i == len(parts) - 1)
            thought, content = thought + a, content + b
        assert (thought.strip("\n"), content) == ((want[0] or ""), want[1]), parts


class _Sub:
    """A Submission's stream of events, for chat_chunks."""
    def __init__(self, deltas, final):
        self.params = type("P", (), {"n": 1})()
        self.prompts = ["p"]
        self._batches = [[(0, d)] for d in deltas] + [[(0, final)]]

    async def batches(self):
        for b in self._batches:
            yield b


def _output(text):
    return RequestOutput(7, "p", [1], [CompletionOutput(0, text, [1, 2], None, None, "stop")], True,
                         RequestMetrics(0.0, 0.1, 0.2))


def test_chat_response_and_chunks_carry_reasoning_content():
    text = "<think>\nplan\n</think>\n\nanswer"
    reply = ReplyFormat(reasoning=True)
    msg = convert.chat_response(_output(text), "m", None, reply).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("plan", "answer")
    assert convert.chat_response(_output(text), "m", None).choices[0].message.content == text  # parser off
    pieces = ["<th", "ink>\npl", "an\n</thi", "nk>\n\nans", "wer"]
    deltas = [StreamDelta(0, 0, 7, p, [1], None, i == len(pieces) - 1, "stop" if i == len(pieces) - 1 else None)
              for i, p in enumerate(pieces)]

    async def collect():
        return [c async for c in convert.chat_chunks(_Sub(deltas, _output(text)), "m", False, None, reply)]
    chunks = asyncio.run(collect())
    thought = "".join(c.choices[0].delta.reasoning_content or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (thought.strip("\n"), content) == ("plan", "answer")
    assert chunks[-1].choices[0].finish_reason == "stop"
