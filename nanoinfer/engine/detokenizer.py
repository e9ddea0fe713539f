"""Incremental detokenization and stop-string matching for one completion.

Byte-level BPE splits a UTF-8 character across tokens, so the text of a token is not the text of the
token alone: decode a window of ids from a clean boundary (`prefix_offset`) and release only what
the newest ids added, and hold back while the window ends in U+FFFD (a character still incomplete).
Released text therefore always ends on a character boundary and the concatenation of all releases
equals decoding every id at once.
"""
from nanoinfer.sampling_params import SamplingParams

# Like vLLM: a few prompt tokens of context for decoding the first completion tokens.
INITIAL_OFFSET = 5


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """Decode, skipping ids past the tokenizer's vocabulary (checkpoints pad the embedding)."""
    n = len(tokenizer)
    return tokenizer.decode([t for t in token_ids if t < n], skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], sp: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = sp.skip_special_tokens
        self.stop = sp.stop
        self.include_stop = sp.include_stop_str_in_output
        # while running, this many trailing characters are withheld from streaming: they may be the
        # start of a stop string that will be cut (vLLM's stop_buffer_length)
        self.holdback = max((len(s) for s in sp.stop), default=1) - 1 if not sp.include_stop_str_in_output else 0
        context = prompt_token_ids[-INITIAL_OFFSET:]
        self.ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stopped = False

    def _decode(self, ids):
        return decode(self.tokenizer, ids, self.skip_special_tokens)

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
