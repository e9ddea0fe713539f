"""The engine loop: every step schedules step N+1, launches it on the device, then processes step N
on the host while the device computes N+1 (`async_scheduling=False`: the step just launched, at
once). Processing is one path (docs/architecture.md, "the token path").

Features attach through the hooks of step/feature.py, called at fixed points; a step a feature
awaits (`Launched.awaits`: launched up to its logits, e.g. waiting for token masks) completes before
the next step's forward or before its results are collected. The composition place above the engine
(nanoinfer/features.py) picks the features, the row planner and the scheduler's order.

One thread drives the engine (engine/engine_threads.py); `add_request`, `abort_request` and `exit`
may be called from any thread: an abort is applied between steps, exit waits for the running step.
"""
import atexit
import gc
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

from nanoinfer.config import Config
from nanoinfer.engine.engine_requests import EngineRequests
from nanoinfer.engine.engine_threads import EngineThreads
from nanoinfer.step.feature import Composition, EngineParts
from nanoinfer.engine.input_processor import InputProcessor
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.output_processor import OutputProcessor, Request
from nanoinfer.engine.scheduler import ScheduledBatch, Scheduler
from nanoinfer.engine.sigint import sigint_deferred
from nanoinfer.engine.step_encoder import StepEncoder, sampled_rows
from nanoinfer.engine.step_record import StepRecord
from nanoinfer.engine.tp_executor import TensorParallelExecutor
from nanoinfer.utils.hf_files import load_eos_token_ids, load_tokenizer
from nanoinfer.utils.main_guard import check_main_guard

logger = logging.getLogger("nanoinfer")

EXIT_WAIT_S = 60.0  # how long exit() from another thread waits for a running step to end
INTAKE_WAIT_S = 0.05  # how long a step with nothing to run waits for a request's intake work (commands go on)


class LLMEngine(EngineRequests, EngineThreads):
    def __init__(self, model: str, composition: Composition | None = None, **options):
        """composition: which features and row planner the engine runs with (None: none, plain rows)."""
        self.config = config = Config.from_options(model, **options)
        self.tokenizer = load_tokenizer(config.tokenizer)
        # the tokenizer's EOS plus the checkpoint's generation_config eos_token_id(s)
        self.eos_token_ids = eos_token_ids = load_eos_token_ids(config.model, self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        self._exited = False
        # tp > 1: every rank in a spawned worker; num_blocks is the minimum over ranks
        if config.tensor_parallel_size > 1:
            check_main_guard()  # spawned workers re-import the main script
        composition = composition or Composition()
        on_ranks = composition.rank_features(config)
        self.model_runner = ModelRunner(config, rank_features=on_ranks) if config.tensor_parallel_size == 1 \
            else TensorParallelExecutor(config, on_ranks)
        num_blocks = self.model_runner.num_blocks
        # token masks filled after the forward's launch: one rank (tensor parallel: in the plan)
        masks_later = config.tensor_parallel_size == 1
        parts = EngineParts(config, self.tokenizer, eos_token_ids, self.vocab_size, self.model_runner, masks_later)
        try:  # (a planner's own KV cache may share the pool's memory: fewer blocks)
            self.rows = composition.row_planner(parts, num_blocks)
            num_blocks = self.rows.num_blocks or num_blocks
            if num_blocks * config.kvcache_block_size < config.max_model_len:
                self.rows.exit()
                raise ValueError(
                    f"the KV cache holds {num_blocks} blocks x {config.kvcache_block_size} tokens = "
                    f"{num_blocks * config.kvcache_block_size} tokens, less than one "
                    f"max_model_len={config.max_model_len} sequence; raise num_kvcache_blocks / "
                    "gpu_memory_utilization or lower max_model_len")
        except BaseException:
            self.model_runner.exit()
            raise
        self.model_runner.allocate_kv_cache(num_blocks)
        self.rows.allocate(num_blocks)
        self.features = composition.features(parts)  # their hooks are called in this order
        self.scheduler = Scheduler(config, num_blocks, eos_token_ids, config.enable_prefix_caching, self.rows,
                                   composition.admission(config), masks_later, composition.order(config))
        self.step_encoder = StepEncoder(self.vocab_size, eos_token_ids, random.Random(config.seed),
                                        config.tensor_parallel_size > 1 and config.device == "cuda",
                                        self.features, masks_later, self.rows, options := composition.sampling_options())
        self.input_processor = InputProcessor(config, self.tokenizer, self.vocab_size,
                                              num_blocks * config.kvcache_block_size, self.features, options)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[int, Request] = {}
        self.overlap = config.async_scheduling
        self.inflight: Launched | None = None
        self.step_log: list | None = None   # set to a list to record each step's StepRecord (bench.py)
        self._init_threads()
        self._aborts: deque[int] = deque()  # abort_request ids not applied yet
        self._finished_ids: list[int] = []  # requests finished outside a step, for the next advance()
        self._unreported: list[tuple[int, list[int]]] = []  # step()'s pairs not returned yet
        self._waited = 0.0  # seconds the running advance() spent in the runner's collect()
        atexit.register(self.exit)
        gc.freeze()  # what start-up made lives as long as the engine: full collections skip it (as vLLM)

    # ---- loop -----------------------------------------------------------------------------------
    def advance(self) -> tuple[list[int], int]:
        """Run one step. Returns the ids of the requests whose every sample finished (or was
        aborted) in it, and the number of tokens the launched step computes (see step())."""
        self._check_open()
        with self.driving(), self._locked(), sigint_deferred():
            self._check_open()  # (exit() may have run on another thread while this one waited)
            return self._advance()

    def _check_open(self):
        if self._exited:
            raise RuntimeError("this engine has exited; create a new LLM")

    def _advance(self):
        self._apply_aborts()
        self._finished(self.scheduler.admit_prepared(), time.time())  # (requests whose intake failed)
        self._waited = 0.0
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None and self.inflight is None and not self.scheduler.is_finished():
            if self.scheduler.preparing:  # only requests whose intake work runs: wait a little for it
                self.scheduler.wait_for_intake(INTAKE_WAIT_S)
            else:
                batch = self.scheduler.schedule()  # a lone sequence preempted itself: re-admit it now
                if batch is None:
                    raise RuntimeError("the scheduler cannot make progress (a request does not fit the KV cache)")
        t1 = time.perf_counter()
        launched = self._launch(batch) if batch is not None else None
        t2 = time.perf_counter()
        prev, self.inflight = self.inflight, launched
        if prev is not None:
            self._process(prev)
        if launched is not None and launched.awaits:
            self._after_launch(launched)
        if launched is not None and not self.overlap:
            self.inflight = None
            self._process(launched)
        self._drop_wasted_step()
        if self.step_log is not None and batch is not None:
            self.step_log.append(StepRecord.of(batch, t0, t1, t2, time.perf_counter(), self._waited))
        for feature in self.features:
            feature.stepped(self.scheduler)
        finished, self._finished_ids = self._finished_ids, []
        return finished, batch.num_tokens if batch is not None else 0

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Run one step (nano-vllm's contract). Returns the (sequence id, completion token ids) pairs of
        add_request()'s requests that finished since the last step() call, whoever drove the engine
        (aborted ones are not reported; with overlap, one call after their step's launch), and the
        launched step's ScheduledBatch.num_tokens."""
        _, num_tokens = self.advance()
        pairs, self._unreported = self._unreported, []
        return pairs, num_tokens

    def _launch(self, batch: ScheduledBatch) -> "Launched":
        """Launch the batch; if that fails, the engine stays consistent (the batch, and a step in
        flight that failed to complete with it, are unscheduled) and the caller sees the error."""
        prev = self.inflight
        prev_handle = prev.handle if prev is not None else None
        try:
            if self.rows.fills(batch):  # (rows it fills in may read the tokens of the step in flight)
                self._complete(prev)
                self.rows.fill(batch, prev_handle)
            step, sample = self.step_encoder.encode(batch, prev.rows if prev else None)
            self._complete(prev)  # (its forward ran while this step was scheduled and encoded)
            handle = self.model_runner.launch(step, sample, prev_handle, *self.rows.device_inputs(batch))
            self.rows.launched(batch)
        except BaseException:
            self.scheduler.unschedule(batch)
            self.step_encoder.unschedule()
            raise
        return Launched(batch, sampled_rows(batch), handle, self.step_encoder.awaits or None)

    def _after_launch(self, launched: "Launched"):
        """A step its features await, launched (the step before it is processed): it completes now if
        one of them asks, or without overlap."""
        try:
            now = [feature.launched(launched, state) for feature, state in launched.awaits.items()]
        except BaseException:
            self._undo(launched, encoded=True)
            raise
        if any(now) or not self.overlap:
            self._complete(launched, encoded=True)

    def _complete(self, launched: "Launched | None", encoded: bool = False):
        """Finish what a launched step's features await (then it samples); if that fails, the step is
        undone (`encoded`: it was the last step encoded) and the error raised."""
        if launched is None or not launched.awaits:
            return
        awaits, launched.awaits = launched.awaits, None
        try:
            for feature, state in awaits.items():
                feature.complete(launched, state)
        except BaseException:
            self._undo(launched, encoded)
            raise

    def _undo(self, launched: "Launched", encoded: bool):
        """A launched step that failed to complete: out of flight, its rows scheduled again."""
        if self.inflight is launched:
            self.inflight = None
        self.scheduler.unschedule(launched.batch)
        if encoded:
            self.step_encoder.unschedule()

    def _drop_wasted_step(self):
        """A step in flight whose every row has stopped meanwhile is wasted: wait for it and drop it,
        so that is_finished() holds as soon as no request is left."""
        if self.inflight is not None and all(s.is_finished for s in self.inflight.batch.seqs):
            launched, self.inflight = self.inflight, None
            try:
                if not launched.awaits:  # (one a feature still awaits never samples)
                    self._collect(launched.handle)
            except RuntimeError:  # the runner failed (raised where it happened; it refuses further use)
                pass

    def _collect(self, handle):
        """The runner's collect(), timed: the step record's wait for the device (bench.py)."""
        t = time.perf_counter()
        try:
            return self.model_runner.collect(handle)
        finally:
            self._waited += time.perf_counter() - t

    def _process(self, launched: "Launched"):
        """The one path of a step's tokens: the scheduler appends them and decides EOS, stop ids and
        length; the output processor records them and returns stop-string hits; those finish here."""
        self._complete(launched)  # (no step was launched after it: nothing else to undo if it fails)
        result = self._collect(launched.handle)
        now, batch = time.time(), launched.batch
        for feature in self.features:  # (before update finishes their sequences)
            feature.process(batch, result)
        tokens, runs, logprobs = self.rows.results(batch, result)
        update = self.scheduler.update(batch, tokens, runs)
        stops = self.output_processor.record_tokens(batch.seqs, update, logprobs, self.requests, now)
        finished = self.scheduler.finish_rows(batch, update, stops)
        self._finished(finished, now)
        for feature in self.features:
            feature.processed(batch, update, finished)

    def is_finished(self) -> bool:
        return self.inflight is None and self.scheduler.is_finished()

    def check_health(self):
        """Raises RuntimeError if the engine cannot serve: it has exited, or a tensor-parallel rank
        died (noticed here without running a step)."""
        self._check_open()
        self.model_runner.check_alive()

    def exit(self):
        """Release the model, the KV cache and any worker processes. Called from another thread,
        it first waits for the running step to end (a step never uses a released engine), up to
        EXIT_WAIT_S; on the thread inside a step (a signal handler) it cannot wait for itself."""
        if self._lock_holder == threading.get_ident():
            return self._release()
        with self._locked(timeout=EXIT_WAIT_S) as acquired:
            if not acquired:
                logger.warning("exit(): the running step did not end within %g s; releasing the engine anyway",
                               EXIT_WAIT_S)
            self._release()

    def _release(self):
        if self._exited:
            return
        self._exited = True
        self.inflight = None
        self.model_runner.exit()
        self.rows.exit()
        for feature in self.features:
            feature.exit()
        self.input_processor.close()
        atexit.unregister(self.exit)
        gc.unfreeze()  # (the engine's cycles, if any, are collectable again; process-wide, as freeze is)


@dataclass(slots=True)
class Launched:
    """A step launched and not processed yet: its batch, its sampling rows (seq_id -> row), and the
    runner's handle for collecting it."""
    batch: ScheduledBatch
    rows: dict[int, int]
    handle: object  # the runner's: an InFlight (one rank) or a step id (tensor parallel)
    awaits: dict | None = None  # feature -> its state: launched up to its logits, it samples once they complete

