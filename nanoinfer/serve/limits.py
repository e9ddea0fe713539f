"""What one HTTP request may ask of the server, checked before it reaches the engine, so that no
single request can hold up the others: at most `max_n` samples, at most `max_seqs_per_request`
sequences (prompts x n), bounded stop lists, text prompts no longer than any that could fit
max_model_len (refused before they are tokenized), and (enforced by http_guards.BodyLimit) a
bounded body. Each is a server flag; a request past one is a 400 naming the field and its limit."""
from dataclasses import dataclass

from nanoinfer.structured.schema_limits import DEFAULT_MAX_SCHEMA_BYTES, DEFAULT_MAX_SCHEMA_DEPTH, SchemaLimits

# the request fields that hold a JSON schema, a grammar or a list of choices (tools: their parameters)
SCHEMA_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "tools")


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = 128                     # samples per prompt (OpenAI's own limit)
    max_stop_strings: int = 64
    max_stop_chars: int = 1024           # per stop string
    max_stop_token_ids: int = 1024
    max_request_body_bytes: int = 8 << 20
    max_logprobs: int = 20               # vLLM's default; -1: no limit (logprobs=-1 asks for the vocabulary)
    max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH   # nesting of a schema-bearing field (SCHEMA_FIELDS)
    max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES   # size of one, as JSON text
    max_seqs_per_request: int = 2048     # prompts x n: OpenAI's 2048 prompts a request, or n=128 of 16
    max_prompt_chars: int | None = None  # None: prompt_chars_limit(), what max_model_len could hold

    def __post_init__(self):
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= -1, got {self.max_logprobs!r}")
        if self.max_prompt_chars is not None and (not isinstance(self.max_prompt_chars, int)
                                                  or isinstance(self.max_prompt_chars, bool) or self.max_prompt_chars < 1):
            raise ValueError(f"max_prompt_chars must be an int >= 1 (or None), got {self.max_prompt_chars!r}")
        for name in ("max_n", "max_seqs_per_request", "max_stop_strings", "max_stop_chars", "max_stop_token_ids",
                     "max_request_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        SchemaLimits(self.max_schema_depth, self.max_schema_bytes)  # (their checks)

    def check(self, body) -> None:
        """Raises ValueError("<field> ...") for the first field of `body` (a completion or chat
        request) past a limit."""
        if body.n > self.max_n:
            raise ValueError(f"n must be at most {self.max_n} on this server (--max-n), got {body.n}")
        self.check_sequences(len(body.prompts()) if hasattr(body, "prompts") else 1, body.n)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.max_stop_strings:
            raise ValueError(f"stop may hold at most {self.max_stop_strings} strings, got {len(stops)}")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_chars:
            raise ValueError(f"stop strings may be at most {self.max_stop_chars} characters, got {longest}")
        self._check_logprobs(body)
        # before the tools are rendered or a schema parsed: both recurse into it
        SchemaLimits(self.max_schema_depth, self.max_schema_bytes).check_fields(
            {name: getattr(body, name, None) for name in SCHEMA_FIELDS})
        ids = body.stop_token_ids or []
        if len(ids) > self.max_stop_token_ids:
            raise ValueError(f"stop_token_ids may hold at most {self.max_stop_token_ids} ids, got {len(ids)}")

    def check_sequences(self, prompts: int, n: int = 1, field: str = "prompt") -> None:
        """The engine sequences a request makes, prompts x n, within max_seqs_per_request; the error
        names `field` (the prompt list) when n is 1, else n."""
        if prompts * n <= self.max_seqs_per_request:
            return
        if n == 1:
            raise ValueError(f"{field} may hold at most {self.max_seqs_per_request} prompts on this server "
                             f"(--max-seqs-per-request, which bounds prompts x n), got {prompts}")
        raise ValueError(f"n x the number of prompts must be at most {self.max_seqs_per_request} on this server "
                         f"(--max-seqs-per-request), got {prompts} prompts x n={n} = {prompts * n}")

    def _check_logprobs(self, body):
        """Completions' `logprobs`, chat's `top_logprobs`: -1 (the whole vocabulary) counts as more
        than any limit but -1, since every token of the reply would carry the whole vocabulary."""
        name = "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs"
        value = getattr(body, name)
        if value is None or self.max_logprobs == -1:
            return
        if value == -1 or value > self.max_logprobs:
            raise ValueError(f"{name} must be at most {self.max_logprobs} on this server (--max-logprobs), "
                             f"got {value}")


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (a byte-level vocabulary writes one
    character per byte, never fewer than the text's): a text of c characters has at least
    c / longest_token_chars tokens. Read once, at start."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def prompt_chars_limit(limits: ServerLimits, tokenizer, max_model_len: int) -> int:
    """--max-prompt-chars, or by default the most characters a prompt that fits max_model_len can have."""
    if limits.max_prompt_chars is not None:
        return limits.max_prompt_chars
    return max_model_len * longest_token_chars(tokenizer)
