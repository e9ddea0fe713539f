"""The HTTP process's handle on the engine process (messages.py says what the two send).

HTTP handlers never touch the engine. `submit` and `abort` put commands on a queue that a writer
thread sends in batches; a reader thread receives the engine's one message per step and hands it
to the event loop with one `call_soon_threadsafe`, where `_dispatch` puts each submission's news
on its asyncio queue (one list per submission per step).
"""
import asyncio
import itertools
import logging
import queue
import threading
from multiprocessing.connection import wait

from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.process.engine_launch import STOP_TIMEOUT_S, end_engine_process, launch_engine_process
from nanoinfer.process.messages import Abort, EngineDead, Ready, StartFailed, StepNews, Stop, Submit, pack_command
from nanoinfer.serve.metrics import ServerMetrics
from nanoinfer.process.submission import FINAL_OUTPUTS, EngineDeadError, ShutdownCut, Submission

__all__ = ["EngineClient", "EngineDeadError", "FINAL_OUTPUTS", "ShutdownCut", "Submission"]

logger = logging.getLogger("nanoinfer.serve")


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
        self._ending = threading.Lock()
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
        with self._ending:  # (the reader, a failing thread and close() may each end it)
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
                self._call(self._dispatch_or_fail, message)
                if isinstance(message, EngineDead):
                    self._reap()
                    return
        except (EOFError, OSError):
            self.process.join(5)
            self._call(self._failed, f"the engine process exited (code {self.process.exitcode})")
            self._reap()
        except Exception as e:  # a message that cannot be read: fail every waiting client, never hang them
            logger.exception("reading the engine's messages failed")
            self._die(f"{type(e).__name__}: {e}")

    def _write(self):
        """Sends the queued commands in batches, each command pickled on its own: a submission that
        cannot be pickled is refused alone (its client's 400); any other failure here leaves no
        way to reach the engine, so the engine is declared dead and ended."""
        try:
            while True:
                batch = [self._outbox.get()]
                while True:
                    try:
                        batch.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                packed = [p for p in map(self._pack, (c for c in batch if c is not None)) if p is not None]
                if packed:
                    try:
                        self._commands.send(packed)
                    except OSError:  # the engine is gone; the reader reports it
                        pass
                if None in batch:
                    return
        except Exception as e:
            logger.exception("sending commands to the engine failed")
            self._die(f"{type(e).__name__}: {e}")

    def _pack(self, command):
        try:
            return pack_command(command)
        except Exception as e:
            if not isinstance(command, Submit):
                raise
            reason = "it is nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
            self._call(self._refuse, (command.sub_id, ValueError(f"request: cannot be passed to the engine: {reason}")))
            return None

    def _refuse(self, refusal: tuple[int, Exception]):
        """On the event loop: a submission the engine never got fails with `error`."""
        sub_id, error = refusal
        sub = self._subs.pop(sub_id, None)
        if sub is not None:
            self.outstanding_tokens -= sum(sub.costs)
            _resolve(sub.added, error)

    def _dispatch_or_fail(self, message):
        try:
            self._dispatch(message)
        except Exception as e:  # a client left waiting for ever is worse than a dead engine
            logger.exception("handling the engine's message failed")
            self._die(f"{type(e).__name__}: {e}")

    def _die(self, reason: str):
        """From any thread: every waiting client gets an error, the engine counts as dead (/health 503,
        a data-parallel replica is restarted) and its process is ended in the background."""
        self._call(self._failed, reason)
        threading.Thread(target=self._end_process, args=(STOP_TIMEOUT_S,), name="nanoinfer-engine-end",
                         daemon=True).start()

    def _reap(self):
        """The engine process is exiting by itself (EngineDead, or its pipe closed): wait for it so
        that it does not linger as a zombie, ending it if its clean-up hangs."""
        with self._ending:
            self.process.join(3 * STOP_TIMEOUT_S)
        self._end_process(STOP_TIMEOUT_S)  # (a no-op once it has exited)

    def _call(self, fn, arg):
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


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
