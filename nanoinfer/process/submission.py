"""One HTTP request's prompts as the engine client tracks them, and the errors its events may carry."""
import asyncio
from dataclasses import dataclass, field

from nanoinfer.outputs import RequestOutput
from nanoinfer.pooling.outputs import PoolingRequestOutput
from nanoinfer.sampling_params import SamplingParams

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
