"""Tensor parallelism: every rank is a ModelRunner in its own worker process (engine/worker_group.py
runs them); the engine's process only schedules. TensorParallelExecutor has the runner's interface
(num_blocks, allocate_kv_cache, launch, collect, exit, info).

A step's StepInput goes to every rank and its SampleInput to rank 0, which samples and broadcasts
the tokens, so that on every rank the next step's in-flight rows read their input tokens on the
device. Rank 0 answers a launch with the results of the step launched before it, once this one is
enqueued: the engine processes step N while the GPUs compute step N+1, as with one rank.

Why rank 0 is not in the engine's process: a rank there would hold the engine inside a collective
when a peer dies, and NCCL offers no way out of that which cannot itself hang. A worker stuck that
way is simply killed, and the engine raises. What this costs per step (the round trip to the
workers) is measured by `python -m nanoinfer.bench.tp_step`.
"""
import gc
import logging
import os
import pickle
import socket
import traceback

from nanoinfer.config import Config
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.sampling.sampler import SamplingFailed
from nanoinfer.engine.rank_calls import AllocateKVCache, Exit, Flush, Info, Launch, Ping, Reported
from nanoinfer.step.step_message import SampleInput, StepInput, StepResult
from nanoinfer.engine.worker_group import MAX_ERROR_CHARS, WorkerFailure, WorkerGroup

logger = logging.getLogger("nanoinfer")

STEP_TIMEOUT_ENV = "NANOINFER_TP_STEP_TIMEOUT_S"
DEFAULT_STEP_TIMEOUT_S = 60.0  # a step unanswered this long means a rank is stuck (raise it for slow steps)
EXIT_TIMEOUT_S = 10.0          # a polite exit, then SIGKILL
# NVLink multicast off: the small all-reduces of decode do not need it, and it is a shared machine's risk
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def step_timeout() -> float:
    """Seconds the ranks may take to answer a step: NANOINFER_TP_STEP_TIMEOUT_S, default 60."""
    value = os.environ.get(STEP_TIMEOUT_ENV)
    if value is None:
        return DEFAULT_STEP_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        timeout = float("nan")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"{STEP_TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return timeout


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- a rank -------------------------------------------------------------------------------------
def serve_rank(channel, config: Config, init_method: str, rank_features=()):
    """A worker's loop: load this rank's shard, then run the engine's calls until Exit.
    Answers to Launch/Flush: a list of Reported, for the steps reported now."""
    for name, value in NO_MULTICAST.items():  # unless the user asks otherwise
        os.environ.setdefault(name, value)
    runner = ModelRunner(config, channel.rank, init_method, rank_features)
    gc.freeze()  # (as the engine's process does: full collections skip the start-up objects)
    channel.answer(runner.num_blocks)
    ranks = RankLoop(runner, channel)
    while True:
        message = channel.recv()
        if isinstance(message, Launch):
            channel.answer(ranks.launch(message))
        elif isinstance(message, Flush):
            channel.answer(ranks.flush())
        elif isinstance(message, AllocateKVCache):
            runner.allocate_kv_cache(message.num_blocks)
            channel.answer()
        elif isinstance(message, Info):
            channel.answer(runner.info())
        elif isinstance(message, Ping):
            channel.answer()
        elif isinstance(message, Exit):
            runner.exit()
            gc.unfreeze()  # (as the engine does: frozen cycles would keep triton's objects past its teardown)
            channel.answer()
            return
        else:
            raise ValueError(f"unknown call {message!r}")


class RankLoop:
    """A worker's steps: the InFlight of the last step launched and of the one it read (the next
    step reads one of them), and on rank 0 the step launched and not reported yet."""

    def __init__(self, runner: ModelRunner, channel):
        self.runner, self.channel = runner, channel
        self.recent = {}               # step id -> InFlight
        self.awaiting_report = None    # rank 0: a step id

    def launch(self, call: Launch) -> list[Reported]:
        """Launch the step, then report the one launched before it (and this one, when asked)."""
        k, prev, channel, runner = call.step_id, call.prev_id, self.channel, self.runner
        step: StepInput = pickle.loads(channel.payload(call.step_span))
        sample: SampleInput | None = pickle.loads(channel.payload(call.sample_span)) if call.sample_span else None
        failed = []
        try:
            self.recent[k] = runner.launch(step, sample, self.recent.get(prev))
        except SamplingFailed:  # e.g. a user's logits processor raised; the ranks are still in step
            if not call.report_now:  # (nothing else is expected to fail there: the worker fails, loudly)
                raise
            failed.append(Reported(k, error=f"rank 0: {traceback.format_exc()[-MAX_ERROR_CHARS:]}"))
        reported = self.flush() + failed  # (after the launch: the device runs step k while we wait for k-1)
        # the next step reads k's tokens, or prev's again if the engine drops k (its sampling failed)
        self.recent = {key: self.recent[key] for key in (prev, k) if key in self.recent}
        if sample is not None and k in self.recent:
            if call.report_now:
                reported.append(Reported(k, runner.collect(self.recent[k])))
            else:
                self.awaiting_report = k
        return reported

    def flush(self) -> list[Reported]:
        """The report of the step awaiting one, if any."""
        if self.awaiting_report is None:
            return []
        k, self.awaiting_report = self.awaiting_report, None
        return [Reported(k, self.runner.collect(self.recent[k]))]


# ---- the engine's side --------------------------------------------------------------------------
class TensorParallelExecutor:
    def __init__(self, config: Config, rank_features=()):
        """rank_features: what every rank's ModelRunner builds its RankFeatures with (picklable)."""
        self.config = config
        self.world_size = n = config.tensor_parallel_size
        self.step_timeout = step_timeout()
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self._broken: str | None = None   # why the group can no longer be used
        self._closed = False
        self._launched = 0                # step ids
        self._results: dict[int, Reported] = {}
        self._answers_pending = False
        self.group = None
        try:
            self.group = WorkerGroup(n, serve_rank, lambda rank: (config, self.init_method, tuple(rank_features)), "nanoinfer-tp")
            blocks = self.group.wait("start-up")
        except BaseException as e:
            self._fail(e, "during start-up")
        self.num_blocks = min(blocks)
        logger.info("tensor parallel: %d ranks (%s), KV blocks per rank min(%s) = %d", n,
                    "nccl" if config.device == "cuda" else "gloo", blocks, self.num_blocks)

    # ---- the runner's interface -----------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int):
        self._everyone("allocate_kv_cache", AllocateKVCache(num_blocks))  # (graph capture runs collectives)
        self.num_blocks = num_blocks

    def launch(self, step: StepInput, sample: SampleInput, prev: int | None) -> int:
        """Send a step to every rank; returns its id, the handle for collect(). `prev`: the id of
        the step whose tokens its in-flight rows read. A step that runs user logits processors is
        answered at once, so that one that raises fails here (the engine unschedules it)."""
        self._check_usable()
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        plan = pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
        self._settle()
        self._launched = k = self._launched + 1
        report_now = sample.plan.eager
        step_span, sample_span = (0, len(data)), (len(data), len(plan))
        self._call([Launch(k, prev, step_span, sample_span if rank == 0 else None, report_now)
                    for rank in range(self.world_size)], data + plan)
        if report_now:
            self._settle()
            if k in self._results and self._results[k].error is not None:
                raise RuntimeError(f"sampling failed: {self._results.pop(k).error}")
        return k

    def collect(self, k: int) -> StepResult:
        """The results of step `k`, waiting for them: in the answers to a later launch, or, for the
        last step launched, which nobody reports unasked, in the answers to a flush."""
        self._settle()
        if k not in self._results:
            self._call([Flush()] * self.world_size)
            self._settle()
        if k not in self._results:
            raise RuntimeError(f"step {k} was never launched or was already collected")
        return self._results.pop(k).result

    def info(self) -> dict:
        """Rank 0's ModelRunner.info()."""
        return self._everyone("info", Info())[0]

    def ping(self):
        """A round trip through every rank without a forward (what the RPC costs)."""
        self._everyone("a ping", Ping())

    def check_alive(self):
        """Raises RuntimeError (and stops the group) if a rank's process has died: an idle engine
        notices without waiting for its next step."""
        self._check_usable()
        dead = [rank for rank, proc in enumerate(self.group.procs) if not proc.is_alive()]
        if dead:
            self._fail(RuntimeError(f"tensor-parallel rank(s) {dead} died"), "while idle")

    def exit(self):
        if self._closed:
            return
        self._closed = True
        if self.group is None:
            return
        polite = False
        if not self._broken:
            try:
                self._settle(timeout=5.0)
                self.group.call([Exit()] * self.world_size)
                self.group.wait("exit", timeout=EXIT_TIMEOUT_S, exiting=True)
                polite = True
            except (WorkerFailure, RuntimeError):
                pass
        self.group.stop(EXIT_TIMEOUT_S if polite else 0.0)

    # ---- calls ----------------------------------------------------------------------------------
    def _check_usable(self):
        if self._broken:
            raise RuntimeError(f"the tensor-parallel group is unusable: {self._broken}")
        if self._closed:
            raise RuntimeError("the tensor-parallel group has exited")

    def _call(self, messages, payload: bytes | None = None):
        self._check_usable()
        try:
            self.group.call(messages, payload)
        except BaseException as e:
            self._fail(e, "sending a call")
        self._answers_pending = True

    def _answers(self, what: str, timeout: float | None = None) -> list:
        try:
            answers = self.group.wait(what, timeout)
        except BaseException as e:
            self._fail(e, f"waiting for {what}")
        self._answers_pending = False
        return answers

    def _everyone(self, what: str, message) -> list:
        """The same call to every rank, once the last call is answered; returns their answers."""
        self._settle()
        self._call([message] * self.world_size)
        return self._answers(what)

    def _settle(self, timeout: float | None = None):
        """Collect the answers to the last call, if not yet: rank 0's carry step results."""
        if self._answers_pending:
            for report in self._answers("a step", timeout or self.step_timeout)[0] or ():
                self._results[report.step_id] = report

    def _fail(self, error: BaseException, when: str):
        """Any failure mid-call leaves the ranks out of step: stop them all (SIGKILL) and refuse
        further use. A worker's failure becomes a RuntimeError with its error; anything else
        (Ctrl-C, a bug here) is re-raised."""
        worker = isinstance(error, WorkerFailure)
        if not self._broken:
            self._broken = str(error) if worker else f"interrupted {when} ({type(error).__name__}: {error})"
        self._closed = True
        if self.group is not None:
            self.group.stop(0.0)
        if worker:
            raise RuntimeError(f"tensor-parallel worker failure {when}: {error}") from None
        raise error
