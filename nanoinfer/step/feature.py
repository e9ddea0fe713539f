"""The seam through which features attach to the engine. A feature (LoRA, images, structured
outputs, embeddings: each in its own folder) implements some of these hooks; the composition place
above the engine (nanoinfer/features.py) reads the Config and picks which are registered; the engine
calls the registered ones in order at fixed points and never names one. EngineFeature's hooks are
listed in the order a request and a step meet them; a RankFeature's run on every rank.
"""
from dataclasses import dataclass, field

from nanoinfer.step.row_planner import RowPlanner


@dataclass(slots=True)
class Intake:
    """One request at intake, as the features see it."""
    token_ids: list[int]
    params: object  # what the caller gave; a feature may replace it by the SamplingParams the scheduler sees
    extras: dict  # the prompt dict's keys the features read (EngineFeature.prompt_keys), and lora_request
    generates: bool = True  # the request needs room for output tokens
    truncated: bool = False  # the prompt was cut to fit
    seqs: list = field(default_factory=list)
    work: list = field(default_factory=list)  # heavy work, run in order in an intake thread before queueing


@dataclass(slots=True)
class EngineParts:
    """What a feature may be built from."""
    config: object
    tokenizer: object
    eos_token_ids: frozenset
    vocab_size: int
    runner: object  # a ModelRunner, or the TensorParallelExecutor driving the ranks
    masks_later: bool  # one rank: the engine fills a step's token masks after the forward's launch


class EngineFeature:
    """No-op hooks: a feature overrides those it needs."""
    prompt_keys: tuple[str, ...] = ()  # keys of a prompt dict it reads, handed over in Intake.extras

    def check_request(self, intake: Intake) -> None:
        """Intake, before the prompt's length checks: check the request's options; may rewrite its
        prompt tokens or params. Raises ValueError / TypeError for bad input."""

    def prepare(self, intake: Intake) -> None:
        """Intake, the request's sequences built (nothing queued yet): attach state to them, or
        append the work that does so to intake.work."""

    def encode(self, batch, step, sample, sampling_seqs: list):
        """A step's message is built (`sampling_seqs`: its sampling rows' sequences): add this
        feature's part. A value returned is the step's state this feature must `complete` before
        it samples (it was launched up to its logits)."""

    def unschedule(self) -> None:
        """The step last encoded was not launched."""

    def launched(self, launched, state) -> bool:
        """A step returned state from `encode`; it is launched and the step before it processed (its
        tokens are on the host). Returns whether the step must `complete` now."""
        return False

    def complete(self, launched, state) -> None:
        """Before the next step's forward, or before the step's results are collected."""

    def process(self, batch, result) -> None:
        """A step's results, before the scheduler appends its tokens."""

    def processed(self, batch, update, finished: list) -> None:
        """A step's tokens are appended (`update`: the scheduler's StepUpdate), the sequences it ended finished."""

    def stepped(self, scheduler) -> None:
        """An engine step (advance) is over."""

    def request_output(self, request):
        """The request's output, if this feature builds it (else None: the engine's)."""
        return None

    def add_output(self, request, output) -> None:
        """The engine built the request's output: add this feature's part to it."""

    def exit(self) -> None:
        """The engine exits."""


class Composition:
    """Which features an engine runs with: none by default (nanoinfer/features.py chooses by the Config)."""

    def row_planner(self, parts: EngineParts, num_blocks: int) -> RowPlanner:
        """The planner of each step's rows (it may take part of the pool's `num_blocks`)."""
        return RowPlanner()

    def features(self, parts: EngineParts) -> list[EngineFeature]:
        """The features, in the order their hooks are called."""
        return []

    def admission(self, config):
        """The scheduler's rule on which waiting sequence may run (None: any)."""
        return None

    def order(self, config):
        """The order the scheduler serves sequences in (as wait_queue.FifoOrder; None: first come, first served)."""
        return None

    def sampling_options(self) -> list:
        """The per-request logits options (sampling/option.py), new for one engine, in order."""
        return []

    def rank_features(self, config) -> list:
        """Factories of the RankFeatures every rank builds (each called with its ModelRunner)."""
        return []


class RankFeature:
    """A feature's part on a rank, built by each ModelRunner from Composition.rank_features (picklable:
    with tensor parallelism every worker process builds them) before its KV cache is measured."""
    captures_graphs = True  # False: the rank's steps run eager (no CUDA graphs are captured)
    warms_up = True  # False: the warm-up's steps are not this feature's (it is skipped)
    # (forward-context field, padding value): per-token int64 inputs the captured graphs read from
    # static buffers (padded tokens, and steps without the field, read the padding)
    graph_inputs: tuple[tuple[str, int], ...] = ()
    sampler_class = None  # the rank's dispatch instead of sampling/sampler.py's Sampler (a subclass)

    def before_forward(self, step) -> dict | None:
        """Before a step's inputs are prepared (load what it needs: adapters, image embeddings).
        Returns forward-context fields to set once they are, or None; a list or numpy array there
        is sent to the device with the step's index arrays (int64, in their one copy)."""
        return None

    def read_logits(self, step, sample, logits) -> dict | None:
        """The sampling rank, a step with StepInput.extra_logit_rows: those rows' full logits. Returns
        StepResult.outputs entries, each a callable that gives its host value once the step's copies
        are done (start them here, non-blocking), or None."""
        return None

    def exit(self) -> None:
        """The runner releases its model."""
