"""One sequence (one of a request's n samples): its token ids, progress through the KV cache, and
block table.

One length: `num_tokens`, the tokens on the host. With overlapped steps the device may also have
sampled tokens the host has not seen yet: `num_inflight` counts them until their step is processed.
Planning a step counts both and says so: `seq.num_tokens + seq.num_inflight`.
"""
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

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 request_id: int | None = None, index: int = 0):
        self.seq_id = next(Sequence.counter)
        self.request_id = self.seq_id if request_id is None else request_id
        self.index = index                 # which of the request's n samples
        self.priority = 0                  # scheduling_policy="priority": the lower value runs first
        self.pooling = None                # an embedding request's PoolingState (nanoinfer/pooling)
        self.computes_whole_prompt = False  # set at intake: no prefix-cache hit, every position computed
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this sequence's full, committed blocks
        self.num_computed_tokens = 0       # tokens whose K/V are computed or being computed by a launched step
        self.num_cached_tokens = 0         # of those, served by the prefix cache at the last allocation
        self.num_inflight = 0              # tokens sampled by launched steps, not yet appended
        self.num_preemptions = 0           # times its KV was dropped (a draft model's KV goes with it)
        self.finish_reason: str | None = None   # "stop" | "length" | "abort", set by the scheduler only
        self.stop_reason: int | str | None = None
        self.lora_request = None           # the request's LoRARequest (nanoinfer/lora), or None
        self.multi_modal = None            # the prompt's images (multimodal/inputs.py MultiModalInputs), or None
        # heavy intake work still preparing it (a concurrent.futures.Future: a grammar's compile, image
        # preprocessing), or None: the scheduler admits it only once the work is done
        self.intake = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model: it salts the prefix-cache hashes."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        """Tokens on the host: the prompt and the completion tokens appended so far."""
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

    def block_keys(self, i: int) -> tuple[int, ...]:
        """What changes block i's K/V besides its tokens (the content hashes of the images it covers)."""
        return self.multi_modal.block_keys(i, self.block_size) if self.multi_modal is not None else ()

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
