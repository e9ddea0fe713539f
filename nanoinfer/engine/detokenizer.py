"""Incremental detokenization and stop-string matching for one completion.

Byte-level BPE splits a UTF-8 character across tokens: decode a window of ids from a clean boundary
(`prefix_offset`), release only what the newest ids added, and hold back while the window ends in
U+FFFD (a character still incomplete). The releases so concatenate to `completion_text`, the
one-shot decode of requests without stop strings or streaming.

Both decode after the same prompt context (`prompt_context`): the last few prompt ids, so that a
token whose text depends on what precedes it (a SentencePiece word's leading space) decodes as it
does after the prompt. A prompt that ends inside a UTF-8 character gives no context: the
completion's leading bytes of that character are then orphans, each shown as U+FFFD (decoding from
inside the prompt's character would drop them without a trace, or put the prompt's bytes into the
completion's text).
"""
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nanoinfer.sampling_params import SamplingParams

# Like vLLM: a few prompt tokens of context for decoding the first completion tokens.
INITIAL_OFFSET = 5


def encode(tokenizer, text: str) -> list[int]:
    """Tokenize a prompt; text that is not valid Unicode (a lone surrogate such as "\\ud800") is a
    ValueError naming the character, not the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt is not valid Unicode text: {e.object[e.start]!r} at position {e.start} "
                         f"({e.reason})") from None
    return tokenizer.encode(text)


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True) -> str:
    """Decode, skipping ids past the tokenizer's vocabulary (checkpoints pad the embedding).
    spaces_between_special_tokens: as in vLLM, only slow tokenizers use it (fast ones ignore it)."""
    return decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)(token_ids)


def decoder(tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
    """`decode` with the tokenizer and options bound: ids -> str. A fast tokenizer whose class keeps
    the stock decode is called through its Rust backend (with clean-up off the stock decode returns
    exactly its text, and its Python wrapper costs more than the decode; streaming decodes twice a
    token)."""
    n = len(tokenizer)
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and cls.decode is PreTrainedTokenizerBase.decode and \
            cls._decode is PreTrainedTokenizerFast._decode:
        return lambda ids: backend.decode([t for t in ids if t < n], skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode([t for t in ids if t < n], skip_special_tokens=skip_special_tokens,
                                        spaces_between_special_tokens=spaces_between_special_tokens,
                                        clean_up_tokenization_spaces=False)


def prompt_context(decode, prompt_token_ids: list[int]) -> list[int]:
    """The prompt ids a completion is decoded after (`decode`: a decoder): the last INITIAL_OFFSET,
    or none when they end inside a character (see the module docstring)."""
    context = list(prompt_token_ids[-INITIAL_OFFSET:])
    return [] if decode(context).endswith("\ufffd") else context


def completion_text(tokenizer, prompt_token_ids: list[int], token_ids: list[int],
                    skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
    """The text `token_ids` add after the prompt, decoded at once; IncrementalDetokenizer's releases
    concatenate to the same text."""
    decode = decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
    context = prompt_context(decode, prompt_token_ids)
    return decode(context + list(token_ids))[len(decode(context)):] if context else decode(token_ids)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], sp: SamplingParams):
        self._decode = decoder(tokenizer, sp.skip_special_tokens, sp.spaces_between_special_tokens)
        self.stop = sp.stop
        self.include_stop = sp.include_stop_str_in_output
        # while running, this many trailing characters are withheld from streaming: they may be the
        # start of a stop string that will be cut (vLLM's stop_buffer_length)
        self.holdback = max((len(s) for s in sp.stop), default=1) - 1 if not sp.include_stop_str_in_output else 0
        self.ids = prompt_context(self._decode, prompt_token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stopped = False

    def add(self, token_id: int | None, check_stop: bool = True, final: bool = False) -> str | None:
        """Feed one generated token (None: none, only `final`); returns the stop string the new text
        completed, if any (the text is then cut at it). `final`: the completion ends here, so bytes
        held back for an incomplete character are released too."""
        if self.stopped:
            return None
        if token_id is not None:
            self.ids.append(token_id)
        if self.read_offset == len(self.ids):
            return None
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") and not final:
            return None  # an incomplete character: wait for its next bytes
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return self._check_stop(len(delta)) if delta and self.stop and check_stop else None

    def _check_stop(self, num_new: int) -> str | None:
        for s in self.stop:
            # only a match that uses some of the new characters is new
            idx = self.text.find(s, max(0, len(self.text) - num_new - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx + len(s)] if self.include_stop else self.text[:idx]
                self.stopped = True
                return s
        return None

    def releasable(self, finished: bool) -> int:
        """How many characters of `text` may be streamed now."""
        return len(self.text) if finished or self.stopped else max(len(self.text) - self.holdback, 0)
