"""What generate / chat / stream return, shaped like vLLM's outputs."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None            # 1 = the most likely token
    decoded_token: str | None = None


# a sample's "error" stop_reason when no token could be sampled for it: the model output NaN / inf,
# its constraints (allowed ids, bad words, a grammar) masked every token, or its logits processor raised
NON_FINITE_REASON = "no token could be sampled (non-finite logits, every token masked, or a logits processor raised)"


@dataclass
class CompletionOutput:
    index: int                          # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None    # sum of the sampled tokens' logprobs (when logprobs asked)
    logprobs: list[dict[int, Logprob]] | None  # per token: sampled token + top-N (when asked)
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error"; None while running
    # the stop string or stop token id; None for EOS / length; with "error", what failed
    # (NON_FINITE_REASON, or the message of the request's failed intake work)
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __getitem__(self, key: str):
        """c["text"], c["token_ids"], ...: the same as attribute access (as RequestOutput allows)."""
        if not isinstance(key, str):
            raise TypeError(f"CompletionOutput keys are str, got {type(key).__name__}")
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


@dataclass
class RequestMetrics:
    arrival_time: float                 # time.time() when the request was added
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One prompt's result. `out["text"]` and `out["token_ids"]` (nano-vllm style) give the first
    completion's; any other key is a field of the first completion, then of this object."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    # prompt_logprobs asked: None for the first prompt token, then {token: Logprob} per prompt token
    # (the token itself and the top-k)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __getitem__(self, key: str):
        if not isinstance(key, str):
            raise TypeError(f"RequestOutput keys are str, got {type(key).__name__}")
        first = self.outputs[0]
        if hasattr(first, key) and not callable(getattr(first, key)):
            return getattr(first, key)
        if key in self.__dataclass_fields__:
            return getattr(self, key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        try:
            self[key]
        except (KeyError, TypeError):
            return False
        return True

    def get(self, key: str, default=None):
        return self[key] if key in self else default


@dataclass
class StreamDelta:
    """One increment from `LLM.stream`: what a completion produced since the previous delta."""
    index: int                          # the prompt's position in the input list
    completion_index: int               # which of its n completions
    request_id: int
    text: str                           # new text (concatenate them for the full text)
    token_ids: list[int]                # new token ids
    logprobs: list[dict[int, Logprob]] | None = None
    finished: bool = False              # this completion is done; finish_reason says why
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output: RequestOutput | None = field(default=None, repr=False)  # the full result, once every completion of the prompt is done
