"""What the scheduler decides: a step's rows (ScheduledBatch), what processing a step decided
(StepUpdate), and when a sequence's newest token ends it (ending_of)."""
from dataclasses import dataclass, field

from nanoinfer.step.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step's rows: decode rows (one query token) first, then prefill chunks."""
    seqs: list[Sequence]
    starts: list[int]            # first position each row computes
    query_lens: list[int]        # tokens each row computes
    samples: list[bool]          # whether the row's last token samples (False: a prompt chunk short of its end)
    num_decode: int = 0          # leading rows with one query token (decode rows)
    # rows of several tokens (the row planner's), which follow the decode rows: row -> the tokens
    # after its last one (None until filled in); such a row's query is its last token and those
    drafts: dict[int, list[int] | None] = field(default_factory=dict)
    proposals: object = None  # the drafts' tokens, if the planner left them on the device

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """What step() reports: minus the rows of a pure decode step (nano-vllm's convention), else
        every token the step computes (prefill chunks plus decode rows)."""
        return -self.num_decode if self.is_decode_only else sum(self.query_lens)


@dataclass(slots=True)
class StepUpdate:
    """What processing a step decided: the rows whose sampled token was appended, and those that end
    on it by EOS, a stop token id or a length limit (`finish_rows` ends them), in row order."""
    appended: list[int]
    ending: dict[int, tuple[str, int | str | None]]
    counts: dict[int, int] = field(default_factory=dict)  # rows of several tokens: tokens appended (else 1)


def ending_of(sp, token_id: int, num_completion: int, num_tokens: int, eos_token_ids,
              max_model_len: int) -> tuple[str | None, int | None]:
    """(finish reason, stop reason) if a sequence ends on its newest token `token_id`, else (None,
    None): EOS (unless ignore_eos) or a stop id once min_tokens are out, else its length limits."""
    if num_completion >= sp.min_tokens:
        if not sp.ignore_eos and token_id in eos_token_ids:
            return "stop", None  # EOS leaves stop_reason None (vLLM)
        if token_id in sp.stop_token_ids:
            return "stop", token_id
    if (sp.max_tokens is not None and num_completion >= sp.max_tokens) or num_tokens >= max_model_len:
        return "length", None
    return None, None
