"""One request: its token ids, progress through the KV cache, and block table."""
from copy import copy
from enum import Enum, auto
from itertools import count

from nanoinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this sequence's full, computed blocks
        self.num_computed_tokens = 0       # tokens whose K/V are in the cache
        self.num_cached_tokens = 0         # of those, served by the prefix cache at the last allocation
        self.num_scheduled_tokens = 0      # tokens this step computes
        self.finish_reason: str | None = None

    def __len__(self):
        return len(self.token_ids)

    @property
    def is_finished(self):
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self):
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.last_token = token_id
