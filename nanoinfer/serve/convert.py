"""The engine's outputs (RequestOutput, StreamDelta) as OpenAI response bodies and stream chunks.
Prompt i's completion j is choice i * n + j, as in vLLM."""
import time
from collections.abc import AsyncIterator

from nanoinfer.outputs import Logprob, RequestOutput, StreamDelta
from nanoinfer.process.engine_client import Submission
from nanoinfer.serve.chat_reply import ReplyFormat, ReplyStream
from nanoinfer.serve.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                      ChatLogProbs, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                                      CompletionChunk, CompletionLogProbs, CompletionResponse, DeltaMessage,
                                      TopLogprob, UsageInfo, random_id)


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ---- logprobs -----------------------------------------------------------------------------------
MIN_LOGPROB = -9999.0  # what -inf (or NaN) is sent as: JSON has no infinities (vLLM sends the same)


def finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # (NaN compares False: it becomes the floor too)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        offset: int = 0) -> CompletionLogProbs:
    """Completions' shape: per token its text, logprob, text offset, and top entries (the sampled
    token's among them, so up to logprobs + 1, as OpenAI and vLLM return)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, entries in zip(token_ids, logprobs):
        token = entries[tid].decoded_token or ""
        tokens.append(token)
        token_logprobs.append(finite(entries[tid].logprob))
        top = {}
        for lp in sorted(entries.values(), key=lambda lp: lp.rank or 0):
            top.setdefault(lp.decoded_token or "", finite(lp.logprob))  # tokens with the same text: the likeliest
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token)
    return CompletionLogProbs(text_offset=text_offset, token_logprobs=token_logprobs, tokens=tokens,
                              top_logprobs=top_logprobs)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> ChatLogProbs:
    """Chat's shape: per token its text, logprob, UTF-8 bytes and the top_n most likely tokens."""
    content = []
    for tid, entries in zip(token_ids, logprobs):
        top = sorted((lp for t, lp in entries.items() if t != tid or (lp.rank or top_n + 1) <= top_n),
                     key=lambda lp: lp.rank or 0)[:top_n]
        content.append(ChatTokenLogprob(**_top(entries[tid]), top_logprobs=[TopLogprob(**_top(lp)) for lp in top]))
    return ChatLogProbs(content=content)


def _top(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return dict(token=token, logprob=finite(lp.logprob), bytes=list(token.encode("utf-8", errors="replace")))


# ---- whole responses ----------------------------------------------------------------------------
def completion_response(outputs: list[RequestOutput], model: str, echo: bool = False,
                        tokenizer=None) -> CompletionResponse:
    """echo: each choice's text and logprobs start with its prompt's (the first prompt token has
    no logprob: None, as OpenAI and vLLM send it)."""
    choices = []
    for i, out in enumerate(outputs):
        prompt = _prompt_text(out, tokenizer) if echo else ""
        for c in out.outputs:
            lps = None
            if c.logprobs is not None:
                lps = completion_logprobs(c.token_ids, c.logprobs, len(prompt))
                if echo:
                    lps = _join(_prompt_logprobs(out, tokenizer), lps)
            choices.append(CompletionChoice(index=i * len(out.outputs) + c.index, text=prompt + c.text, logprobs=lps,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(model=model, choices=choices, usage=usage(outputs))


def _prompt_text(out: RequestOutput, tokenizer) -> str:
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _prompt_logprobs(out: RequestOutput, tokenizer) -> CompletionLogProbs:
    tokens, token_logprobs, top_logprobs, text_offset, offset = [], [], [], [], 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, lps in zip(out.prompt_token_ids, entries):
        if lps is None or tid not in lps:
            token = tokenizer.decode([tid]) if tokenizer is not None else ""
            tokens.append(token)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token = lps[tid].decoded_token or ""
            tokens.append(token)
            token_logprobs.append(finite(lps[tid].logprob))
            top = {}
            for lp in sorted(lps.values(), key=lambda lp: lp.rank or 0):
                top.setdefault(lp.decoded_token or "", finite(lp.logprob))
            top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token)
    return CompletionLogProbs(text_offset=text_offset, token_logprobs=token_logprobs, tokens=tokens,
                              top_logprobs=top_logprobs)


def _join(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def chat_response(out: RequestOutput, model: str, top_logprobs: int | None,
                  reply: ReplyFormat = ReplyFormat()) -> ChatCompletionResponse:
    """reply: how each reply's text becomes its message (reasoning, tool calls: serve/chat_reply.py)."""
    choices = []
    for c in out.outputs:
        lps = None if c.logprobs is None or top_logprobs is None else \
            chat_logprobs(c.token_ids, c.logprobs, top_logprobs)
        fields, finish_reason = reply.message(c.text, c.finish_reason)
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(**fields), logprobs=lps,
                                  finish_reason=finish_reason, stop_reason=c.stop_reason))
    return ChatCompletionResponse(model=model, choices=choices, usage=usage([out]))


# ---- streams ------------------------------------------------------------------------------------
async def completion_chunks(sub: Submission, model: str, include_usage: bool) -> AsyncIterator[CompletionChunk]:
    head = dict(id=random_id("cmpl"), object="text_completion", created=int(time.time()), model=model)
    n = sub.params.n
    offsets: dict[int, int] = {}  # choice -> text offset of its next token
    outputs = []
    async for i, item in _stream_events(sub):
        if isinstance(item, RequestOutput):
            outputs.append(item)
            continue
        d: StreamDelta = item
        index = i * n + d.completion_index
        lps = None
        if d.logprobs is not None:
            lps = completion_logprobs(d.token_ids, d.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(map(len, lps.tokens))
        yield CompletionChunk(**head, choices=[CompletionChoice(
            index=index, text=d.text, logprobs=lps, finish_reason=d.finish_reason, stop_reason=d.stop_reason)])
    if include_usage:
        yield CompletionChunk(**head, choices=[], usage=usage(outputs))


async def chat_chunks(sub: Submission, model: str, include_usage: bool, top_logprobs: int | None,
                      reply: ReplyFormat = ReplyFormat()) -> AsyncIterator[ChatCompletionChunk]:
    head = dict(id=random_id("chatcmpl"), object="chat.completion.chunk", created=int(time.time()), model=model)
    for j in range(sub.params.n):  # first the role of every choice, as OpenAI and vLLM send it
        yield ChatCompletionChunk(**head, choices=[ChatStreamChoice(
            index=j, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None)])
    outputs = []
    streams: dict[int, ReplyStream] = {}  # choice -> its reply's parsing
    async for _, item in _stream_events(sub):
        if isinstance(item, RequestOutput):
            outputs.append(item)
            continue
        d: StreamDelta = item
        lps = None if d.logprobs is None or top_logprobs is None else \
            chat_logprobs(d.token_ids, d.logprobs, top_logprobs)
        stream = streams.setdefault(d.completion_index, reply.stream())
        thought, text, calls = stream.feed(d.text, d.finished, d.finish_reason)
        delta = DeltaMessage(content=text)
        if thought:
            delta.reasoning_content = thought
        if calls:
            delta.tool_calls = calls
        finish_reason = "tool_calls" if d.finished and stream.made_calls and d.finish_reason != "length" \
            else d.finish_reason
        yield ChatCompletionChunk(**head, choices=[ChatStreamChoice(
            index=d.completion_index, delta=delta, logprobs=lps, finish_reason=finish_reason,
            stop_reason=d.stop_reason)])
    if include_usage:
        yield ChatCompletionChunk(**head, choices=[], usage=usage(outputs))


async def _stream_events(sub: Submission):
    """The submission's (prompt index, StreamDelta | RequestOutput) events for a stream: one
    delta per completion per engine step, a completion's deltas queued meanwhile merged into one
    only when the reader falls behind (a client, or an event loop, slower than the engine gets
    fewer, larger chunks), and a closing delta for each completion whose stream ended without one
    (aborted), so that every choice ends with its finish_reason.

    A delta with new tokens but no text yet (the detokenizer holds back an incomplete character,
    or a stop string's possible start; special tokens decode to nothing) is still a chunk, with
    text "", as vLLM sends it: dropping those merged the tokens into the next chunk with text,
    which for a completion of byte tokens that never form a character is its last (the whole
    completion in one chunk). Only a delta with neither tokens nor text is dropped."""
    done = set()
    async for batch in sub.batches():
        deltas: dict[tuple[int, int], StreamDelta] = {}  # (prompt, completion) -> merged delta
        finals = []
        for i, item in batch:
            if isinstance(item, RequestOutput):
                finals.append((i, item))
            else:
                key = (i, item.completion_index)
                deltas[key] = _merge(deltas[key], item) if key in deltas else item
        for (i, j), d in deltas.items():
            if d.finished:
                done.add((i, j))
            elif not d.text and not d.token_ids and d.logprobs is None:
                continue  # nothing new
            yield i, d
        for i, out in finals:
            for c in out.outputs:
                if (i, c.index) not in done:
                    yield i, StreamDelta(i, c.index, out.request_id, "", [], None, True,
                                         c.finish_reason or "abort", c.stop_reason)
            yield i, out


def _merge(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return StreamDelta(a.index, a.completion_index, a.request_id, a.text + b.text, a.token_ids + b.token_ids,
                       logprobs, b.finished, b.finish_reason, b.stop_reason)
