"""The one thread that drives the engine for the server.

HTTP handlers never touch the engine: they put messages on a thread-safe queue (add a group of
requests, abort one, stop) and read results from an asyncio queue that this thread feeds through
`loop.call_soon_threadsafe`, one call per engine step. Only this thread calls add_request /
advance / stream_deltas / pop_output, so requests from every client share the engine's steps.
"""
import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams

logger = logging.getLogger("nanoinfer.serve")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class Submission:
    """One HTTP request's prompts, queued together (all or none). Its `events` are
    (prompt_index, StreamDelta) while streaming and (prompt_index, RequestOutput) at the end of
    each prompt, or an exception if the engine fails."""
    prompts: list
    params: SamplingParams
    stream: bool
    added: asyncio.Future          # resolved by the engine thread: None, or the add_request error
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_ids: list[int] = field(default_factory=list)

    async def batches(self):
        """Lists of the events queued since the previous list (waiting for at least one), until
        every prompt's RequestOutput has arrived."""
        left = len(self.prompts)
        while left:
            batch = [await self.events.get()]
            while not self.events.empty():
                batch.append(self.events.get_nowait())
            for event in batch:
                if isinstance(event, BaseException):
                    raise event
                left -= isinstance(event[1], RequestOutput)
            yield batch

    async def results(self):
        """The events one by one."""
        async for batch in self.batches():
            for event in batch:
                yield event


class EngineLoop:
    def __init__(self, llm):
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[int, tuple[Submission, int]] = {}   # engine thread only
        self._streaming: dict[int, None] = {}                    # ordered set of streamed request ids
        # read by /stats: requests in the engine now; since start: requests done, their tokens
        self.num_requests = self.num_finished = self.prompt_tokens = self.generation_tokens = 0
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="nanoinfer-engine", daemon=True)

    # ---- called from the event loop -------------------------------------------------------------
    def start(self):
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def submit(self, prompts: list, params: SamplingParams, stream: bool) -> Submission:
        """Queue one engine request per prompt; raises the engine's ValueError / TypeError (and
        queues none) if any is invalid."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        sub = Submission(prompts, params, stream, self._loop.create_future())
        self._inbox.put(("add", sub))
        try:
            await asyncio.shield(sub.added)
        except asyncio.CancelledError:  # the client left before the engine took the requests
            sub.added.add_done_callback(lambda f: f.exception() or self.abort(sub))
            raise
        return sub

    def abort(self, sub: Submission):
        """Stop what is left of a submission (its blocks are freed); safe to call more than once."""
        for rid in sub.request_ids:
            self._inbox.put(("abort", rid))

    def stop(self, timeout: float | None = None):
        """Abort whatever is left and end the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self):
        try:
            while self._handle_messages(block=self.llm.is_finished()):
                if not self.llm.is_finished():
                    self._step()
        except BaseException as e:  # the engine failed: every waiting client gets an error
            logger.exception("the engine loop failed")
            self.error = e
            failure = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
            self._post([(sub.events, failure) for sub in {sub for sub, _ in self._requests.values()}])
            self._requests.clear()
        finally:
            self.num_requests = 0

    def _handle_messages(self, block: bool) -> bool:
        """Apply the queued messages (waiting for one if `block`); False once told to stop."""
        try:
            message = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = message
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            else:  # stop
                for rid in list(self._requests):
                    self._abort(rid)
                return False
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, sub: Submission):
        try:  # all or none
            ids = self.llm.add_requests(sub.prompts, [sub.params] * len(sub.prompts), stream=sub.stream,
                                        keep_output=True)
        except Exception as e:  # ValueError / TypeError naming the field: the client's 400
            self._post([(sub.added, e)])
            return
        for i, rid in enumerate(ids):
            self._requests[rid] = (sub, i)
            if sub.stream:
                self._streaming[rid] = None
        sub.request_ids = ids
        self.num_requests = len(self._requests)
        self._post([(sub.added, None)])

    def _abort(self, rid: int):
        if rid in self._requests:  # else it already finished
            self.llm.abort_request(rid)
            self._post([self._finish(rid)])

    def _step(self):
        finished, _ = self.llm.advance()
        events = []
        for rid in self._streaming:
            deltas = self.llm.stream_deltas(rid)
            if deltas:
                sub, i = self._requests[rid]
                events.extend((sub.events, (i, d)) for d in deltas)
        events.extend(self._finish(rid) for rid in finished if rid in self._requests)
        if events:
            self._post(events)

    def _finish(self, rid: int) -> tuple[asyncio.Queue, tuple[int, RequestOutput]]:
        """Forget a finished (or aborted) request; returns its final-output event."""
        sub, i = self._requests.pop(rid)
        self._streaming.pop(rid, None)
        out = self.llm.pop_output(rid)
        self.num_requests = len(self._requests)
        self.num_finished += 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
        return sub.events, (i, out)

    def _post(self, items: list):
        """Deliver (queue or future, item) pairs on the event loop, in one hop per engine step."""
        try:
            self._loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def _deliver(items: list):
    """On the event loop: put each item in its queue, or resolve its future (None: ok, else error)."""
    for target, item in items:
        if isinstance(target, asyncio.Future):
            if not target.done():
                target.set_result(None) if item is None else target.set_exception(item)
        else:
            target.put_nowait(item)
