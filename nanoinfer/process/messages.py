"""Everything the HTTP process and the engine process send each other, one dataclass per kind
(pickled over two one-way pipes; each send is a batch). A leaf: it imports no serve code.

  HTTP -> engine, a list of packed commands per send (pack_command):   Submit, Abort, Stop
  engine -> HTTP:  StartFailed or Ready once, then a StepNews per engine step that has news,
                   and EngineDead if the engine loop fails (the process then exits)

A stream's deltas are the engine's own StreamDelta objects (StepNews pickles them compactly); a
finished prompt crosses as its RequestOutput.
"""
import pickle
from dataclasses import dataclass, field

from nanoinfer.outputs import RequestOutput, StreamDelta
from nanoinfer.sampling_params import SamplingParams


# ---- HTTP -> engine -----------------------------------------------------------------------------
@dataclass(slots=True)
class Submit:
    """Queue one HTTP request's prompts, all or none."""
    sub_id: int
    prompts: list
    params: SamplingParams
    stream: bool
    max_tokens_must_fit: bool = True  # False: max_tokens past max_model_len stops there (offline's rule)
    priority: int = 0
    lora_request: object = None  # a LoRARequest for every prompt, or None


@dataclass(slots=True)
class Abort:
    """Stop what is left of a submission."""
    sub_id: int


@dataclass(slots=True)
class Stop:
    """Abort everything and exit."""


# Each command is pickled on its own, so that one that cannot be pickled (or unpickled) fails only
# the submission it carries, never the batch it was sent with.
PackedCommand = tuple[int | None, bytes]  # (the Submit's sub_id, or None; the pickled command)


def pack_command(command) -> PackedCommand:
    """Raises what pickling raises (RecursionError for a request nested too deeply)."""
    sub_id = command.sub_id if isinstance(command, Submit) else None
    return sub_id, pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_command(packed: PackedCommand):
    return pickle.loads(packed[1])


# ---- engine -> HTTP -----------------------------------------------------------------------------
_REMOTE_TYPES = {"ValueError": ValueError, "TypeError": TypeError}  # the client's 400s; others are 500s


@dataclass(slots=True)
class RemoteError:
    """An exception raised in the engine process, by type name: it is raised again in the HTTP
    process as that type if it is a ValueError or TypeError (invalid input), else a RuntimeError."""
    type_name: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> "RemoteError":
        return cls(type(e).__name__, str(e))

    def exception(self) -> Exception:
        return _REMOTE_TYPES.get(self.type_name, RuntimeError)(self.message)


@dataclass(slots=True)
class StartFailed:
    """Building the LLM raised `error`; the process exits."""
    error: RemoteError


@dataclass(slots=True)
class Ready:
    """The LLM is built; the HTTP process renders chat prompts with this copy of its tokenizer.
    `summary`: what the start-up log shows (dtype, KV blocks, block size, most sequences at once)."""
    model: str
    max_model_len: int
    tokenizer: object
    summary: dict = field(default_factory=dict)


@dataclass(slots=True)
class EngineStats:
    """The engine's state after a step, for /metrics: sequences running and waiting, KV blocks in
    use of the pool, and preemptions since start."""
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks: int = 1
    preemptions: int = 0
    spec: tuple[int, int, int] | None = None  # speculative decoding: drafts, draft tokens, accepted tokens
    counters: dict[str, list[int]] | None = None  # the model's device counters (utils/counters.py), when read


@dataclass(slots=True)
class Admission:
    """The engine's answer to a Submit: the request id of each prompt, in order, or the error that
    queued none of them."""
    sub_id: int
    request_ids: list[int] = field(default_factory=list)
    error: RemoteError | None = None


@dataclass(slots=True)
class StepNews:
    """What one engine step (and the commands applied before it) produced: admissions first, then
    the step's stream deltas (StreamDelta.index: the prompt's position in its submission), then the
    outputs of the requests that finished or were aborted."""
    admissions: list[Admission]
    deltas: list[StreamDelta]
    finals: list[RequestOutput]
    stats: EngineStats | None = None

    def __reduce__(self):
        # each delta as the values of StreamDelta's fields but `output` (which LLM.stream alone
        # sets), rebuilt on arrival: pickling an object per delta would cost the engine's step
        # loop several times more
        deltas = [(d.index, d.completion_index, d.request_id, d.text, d.token_ids, d.logprobs, d.finished,
                   d.finish_reason, d.stop_reason) for d in self.deltas]
        return _step_news, (self.admissions, deltas, self.finals, self.stats)


def _step_news(admissions: list[Admission], deltas: list[tuple], finals: list[RequestOutput],
               stats: EngineStats | None = None) -> StepNews:
    return StepNews(admissions, [StreamDelta(*fields) for fields in deltas], finals, stats)


@dataclass(slots=True)
class EngineDead:
    """The engine loop failed (or the process was terminated); every waiting client gets `reason`."""
    reason: str
