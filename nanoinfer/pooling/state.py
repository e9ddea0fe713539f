"""One embedding request's pooling, on the host: which of its rows' final hidden states a step
reduces, what came back, and the embedding made of it.

A step's row computes query tokens start .. start + q - 1 of the prompt. Last-token pooling wants
the prompt's last position (always computed: a prefix-cache hit never covers it), CLS the first,
mean every position (so a mean or CLS request takes no prefix-cache hit). A row that starts at
position 0 restarts the sum: a preempted sequence recomputes from there."""
import torch

from nanoinfer.pooling.params import PoolingParams


class PoolingState:
    __slots__ = ("pooling_type", "params", "num_prompt_tokens", "value")

    def __init__(self, pooling_type: str, params: PoolingParams, num_prompt_tokens: int):
        self.pooling_type = pooling_type
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.value: torch.Tensor | None = None  # float32 [hidden]: the pooled sum so far

    @property
    def uses_prefix_cache(self) -> bool:
        return self.pooling_type == "LAST"

    def segment(self, start: int, query_len: int) -> tuple[int, int] | None:
        """(offset in the row, count) of the row's query tokens this pooling sums, or None."""
        if self.pooling_type == "LAST":
            return (query_len - 1, 1) if start + query_len == self.num_prompt_tokens else None
        if self.pooling_type == "CLS":
            return (0, 1) if start == 0 else None
        return 0, query_len

    def add(self, start: int, pooled: torch.Tensor):
        self.value = pooled if start == 0 or self.value is None else self.value + pooled

    def embedding(self) -> torch.Tensor:
        """The finished embedding: mean divided by the prompt length, cut to `dimensions`, then
        normalised (vLLM's order)."""
        x = self.value
        if self.pooling_type == "MEAN":
            x = x / self.num_prompt_tokens
        if self.params.dimensions is not None:
            x = x[:self.params.dimensions]
        if self.params.normalize is not False:
            x = torch.nn.functional.normalize(x, dim=-1)
        return x
