"""The HTTP process's handle on the engine process (messages.py says what the two send).

HTTP handlers never touch the engine. `submit` and `abort` put commands on a queue that a writer
thread sends in batches; a reader thread receives the engine's one message per step and hands it
to the event loop with one `call_soon_threadsafe`, where `_dispatch` puts each submission's news
on its asyncio queue (one list per submission per step).
"""
import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from nanoinfer.outputs import RequestOutput
from nanoinfer.pooling.outputs import PoolingRequestOutput
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.serve.engine_process import EXIT_SIGNAL, engine_main
from nanoinfer.serve.metrics import ServerMetrics
from nanoinfer.serve.messages import Abort, EngineDead, Ready, StartFailed, StepNews, Stop, Submit

logger = logging.getLogger("nanoinfer.serve")

STOP_TIMEOUT_S = 5.0   # a stopping engine aborts its requests and stops its workers; then SIGTERM, SIGKILL


FINAL_OUTPUTS = (RequestOutput, PoolingRequestOutput)  # a request's last event: its output


class EngineDeadError(RuntimeError):
    pass


class ShutdownCut(Exception):
    """The server is shutting down and its grace period is over: a request still running is cut."""


@dataclass
class Submission:
    """One HTTP request's prompts, queued together (all or none). Its `events` get, per engine step,
    a list of (prompt_index, StreamDelta) while streaming and (prompt_index, RequestOutput) at the
    end of each prompt, or an exception if the engine fails."""
    id: int
    prompts: list
    params: SamplingParams
    stream: bool
    added: asyncio.Future          # resolved with None, or the add_requests error
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: int = 0            # prompts without their RequestOutput yet (the engine client's count)
    costs: list[int] = field(default_factory=list)  # each prompt's tokens to prefill and generate, at most

    async def batches(self):
        """Lists of the events queued since the previous list (waiting for at least one), until
        every prompt's RequestOutput has arrived."""
        left = len(self.prompts)
        while left:
            items = [await self.events.get()]
            while not self.events.empty():
                items.append(self.events.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                batch.extend(item)
            left -= sum(isinstance(event, FINAL_OUTPUTS) for _, event in batch)
            yield batch

    async def results(self):
        """The events one by one."""
        async for batch in self.batches():
            for event in batch:
                yield event


class EngineClient:
    """Starts the engine process (building the LLM there) and talks to it; `start` on the event
    loop, `stop` to end it. Counters for /stats: requests in the engine now; since start, requests
    finished or aborted and their prompt and generated tokens; and for a data-parallel router,
    `outstanding_tokens`: the tokens the submissions not finished yet may still cost (prompt plus
    n x max_tokens each, counted from the moment they are submitted).

    env: environment variables the engine process starts with (a data-parallel replica's
    CUDA_VISIBLE_DEVICES). wait=False returns once the process is started; `wait_ready` then
    waits for the engine, and `close` may end it meanwhile."""

    def __init__(self, model: str, options: dict, log_level: str = "warning", env: dict | None = None,
                 wait: bool = True):
        self.process, self._commands, self._events = self._launch(model, options, log_level, env or {})
        self.error: str | None = None
        self.num_requests = self.num_finished = self.prompt_tokens = self.generation_tokens = 0
        self.outstanding_tokens = 0
        self._subs: dict[int, Submission] = {}
        self._requests: dict[int, tuple[Submission, int]] = {}  # engine request id -> (submission, prompt index)
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="nanoinfer-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="nanoinfer-engine-writer", daemon=True)
        self.metrics: ServerMetrics | None = None  # set by the app: fed from every engine message
        if wait:
            self.wait_ready()

    def _launch(self, model: str, options: dict, log_level: str, env: dict):
        """(process, commands pipe, events pipe) of a new engine process; a subclass may put the
        process elsewhere (data_parallel/ray_replica.py) behind objects with the same methods."""
        return launch_engine_process(model, options, log_level, env)

    def wait_ready(self):
        """Wait for the engine to be built (minutes for a large model); raises as _wait_ready says,
        with the process ended."""
        try:
            info = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.model, self.max_model_len, self.tokenizer = info.model, info.max_model_len, info.tokenizer
        self.summary = info.summary

    def _wait_ready(self) -> Ready:
        """The engine's Ready; raises what building the LLM raised (ValueError / TypeError for bad
        options), or RuntimeError if the process died."""
        wait([self._events, self.process.sentinel])
        try:
            message = self._events.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting") \
                from None
        if isinstance(message, StartFailed):
            raise message.error.exception()
        return message

    # ---- on the event loop ----------------------------------------------------------------------
    def start(self):
        self._loop = asyncio.get_running_loop()
        self._reader.start()
        self._writer.start()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and self.process.is_alive()

    async def submit(self, prompts: list, params: SamplingParams, stream: bool,
                     max_tokens_must_fit: bool = True, priority: int = 0, lora_request=None) -> Submission:
        """Queue one engine request per prompt (under adapter `lora_request`, if given); raises the
        engine's ValueError / TypeError (and queues none) if any is invalid. max_tokens_must_fit=False:
        max_tokens past max_model_len stops at it (as offline) instead of being an error (as vLLM's
        server)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running" if self.error is None else _public(self.error))
        sub = Submission(next(self._ids), prompts, params, stream, self._loop.create_future(),
                         costs=[self._cost(p, params) for p in prompts])
        self._subs[sub.id] = sub
        self.outstanding_tokens += sum(sub.costs)
        self._outbox.put(Submit(sub.id, prompts, params, stream, max_tokens_must_fit, priority, lora_request))
        try:
            await asyncio.shield(sub.added)
        except asyncio.CancelledError:  # the client left: the abort follows the add down the pipe
            sub.added.add_done_callback(lambda f: f.exception())  # an add error nobody reads now
            self.abort(sub)
            raise
        return sub

    def _cost(self, prompt, params: SamplingParams | None) -> int:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        length = len(ids) if isinstance(ids, (list, tuple)) else 0  # (text: the engine tokenizes it)
        max_tokens = getattr(params, "max_tokens", None) or max(self.max_model_len - length, 1)
        return length + getattr(params, "n", 1) * max_tokens

    def abort(self, sub: Submission):
        """Stop what is left of a submission (its blocks are freed); safe to call more than once, and
        with another client's submission (a no-op)."""
        if self._subs.get(sub.id) is sub:
            self._outbox.put(Abort(sub.id))

    def cut_all(self, message: str):
        """Shutdown's grace period is over: every request still running ends now with `message`
        (a stream with an error event and [DONE]) and is aborted in the engine."""
        for sub in list(self._subs.values()):
            if sub.added.done():
                sub.events.put_nowait(ShutdownCut(message))
                self.abort(sub)

    def stop(self, timeout: float = STOP_TIMEOUT_S):
        """Abort whatever is left and end the engine process (and its workers), within about
        3 x timeout even if the engine is stuck in a step."""
        self._stopping = True
        self._outbox.put(Stop())
        self.process.join(timeout)
        self.close(timeout)

    def close(self, timeout: float = STOP_TIMEOUT_S):
        """End the engine process if it still runs (EXIT_SIGNAL: it cleans up; then SIGKILL)."""
        self._stopping = True
        self._end_process(timeout)
        self._outbox.put(None)  # ends the writer thread
        for t in (self._writer, self._reader):
            if t.is_alive():
                t.join(10)

    def _end_process(self, timeout: float):
        end_engine_process(self.process, timeout)

    def _dispatch(self, message: StepNews | EngineDead):
        """One engine message, on the event loop."""
        if isinstance(message, EngineDead):
            self._failed(message.reason)
            return
        for admission in message.admissions:
            sub = self._subs[admission.sub_id]
            if admission.error is None:
                for i, rid in enumerate(admission.request_ids):
                    self._requests[rid] = (sub, i)
                sub.unfinished = len(sub.prompts)
                self.num_requests += sub.unfinished
                _resolve(sub.added, None)
            else:
                del self._subs[sub.id]
                self.outstanding_tokens -= sum(sub.costs)
                _resolve(sub.added, admission.error.exception())
        news: dict[int, list] = {}  # sub_id -> its events of this step
        requests = self._requests
        metrics = self.metrics
        if metrics is not None and message.stats is not None:
            metrics.engine_stats(message.stats)
        for d in message.deltas:
            news.setdefault(requests[d.request_id][0].id, []).append((d.index, d))
            if metrics is not None:
                metrics.stream_delta(d.request_id, d.completion_index, len(d.token_ids), d.finished)
        for out in message.finals:
            if metrics is not None:
                metrics.finished(out)
            sub, i = requests.pop(out.request_id)
            news.setdefault(sub.id, []).append((i, out))
            self.outstanding_tokens -= sub.costs[i]
            self.num_requests -= 1
            self.num_finished += 1
            self.prompt_tokens += len(out.prompt_token_ids)
            if isinstance(out, RequestOutput):  # (an embedding generates nothing)
                self.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
        for sub_id, items in news.items():
            sub = self._subs[sub_id]
            sub.events.put_nowait(items)
            sub.unfinished -= sum(isinstance(event, FINAL_OUTPUTS) for _, event in items)
            if sub.unfinished == 0:
                del self._subs[sub_id]

    def _failed(self, reason: str):
        """The engine is gone: every waiting client gets an error."""
        if self.error is not None:
            return
        self.error = reason
        if not self._stopping:
            logger.error("the engine stopped: %s", reason)
        failure = EngineDeadError(_public(reason))
        for sub in self._subs.values():
            if not sub.added.done():
                sub.added.set_exception(failure)
            else:
                sub.events.put_nowait(failure)
        self._subs.clear()
        self._requests.clear()
        self.num_requests = self.outstanding_tokens = 0

    # ---- threads --------------------------------------------------------------------------------
    def _read(self):
        try:
            while True:
                message = self._events.recv()
                self._call(self._dispatch, message)
                if isinstance(message, EngineDead):
                    return
        except (EOFError, OSError):
            self.process.join(5)
            self._call(self._failed, f"the engine process exited (code {self.process.exitcode})")
        except Exception as e:  # a message that cannot be read: fail every waiting client, never hang them
            logger.exception("reading the engine's messages failed")
            self._call(self._failed, f"{type(e).__name__}: {e}")

    def _write(self):
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            commands = [c for c in batch if c is not None]
            if commands:
                try:
                    self._commands.send(commands)
                except OSError:  # the engine is gone; the reader reports it
                    pass
            if len(commands) < len(batch):
                return

    def _call(self, fn, arg):
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def launch_engine_process(model: str, options: dict, log_level: str, env: dict):
    """Start an engine process (engine_process.py); returns it and the ends of its two pipes that
    this process keeps: commands (send) and events (recv)."""
    ctx = mp.get_context("spawn")
    commands_reader, commands = ctx.Pipe(duplex=False)
    events, events_writer = ctx.Pipe(duplex=False)
    # Not daemonic: a daemonic process cannot start the tensor-parallel workers. It exits by
    # itself when this process dies (engine_process.py); stop() / close() end it otherwise.
    process = ctx.Process(target=engine_main, name="nanoinfer-engine",
                          args=(model, options, commands_reader, events_writer, log_level))
    with _environ(env):
        process.start()
    commands_reader.close()  # our copies: the engine's end closing is then an EOF here
    events_writer.close()
    return process, commands, events


def end_engine_process(process, timeout: float = STOP_TIMEOUT_S):
    """End an engine process if it still runs (EXIT_SIGNAL: it cleans up; then SIGKILL)."""
    if process.is_alive():
        try:
            os.kill(process.pid, EXIT_SIGNAL)  # it ignores SIGTERM; this one makes it clean up and exit
        except ProcessLookupError:  # it ended since is_alive()
            pass
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()


_environ_lock = threading.Lock()


@contextmanager
def _environ(env: dict):
    """os.environ with `env` on top, while a process starts (a spawned process copies it)."""
    if not env:
        yield
        return
    with _environ_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _public(reason: str) -> str:
    """What a client is told of an engine failure: its kind, never the details (tracebacks, local
    paths), which the server's log keeps."""
    kind = reason.split(":", 1)[0] if ":" in reason else ""
    if kind.isidentifier():
        return f"the engine failed ({kind}); see the server log"
    return "the engine failed; see the server log"


def _resolve(future: asyncio.Future, error: BaseException | None):
    if not future.done():
        future.set_result(None) if error is None else future.set_exception(error)
