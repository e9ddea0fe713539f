"""The HTTP process's tokenizer work (encoding prompts, rendering chat templates, decoding) in worker
threads, shared so that no request can fill the queue in front of the others:
- two lanes: a job of at most SMALL_JOB_CHARS characters runs on the small lane, a larger one on
  the large lane, so a short prompt never waits behind a long one;
- a request's prompts go in jobs of at most SMALL_JOB_CHARS characters (a longer prompt alone), and
  a request has one job in a lane at a time: the next one queues behind the other requests' jobs.
A prompt's own length is bounded before it gets here (limits.prompt_chars_limit)."""
import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

SMALL_JOB_CHARS = 1 << 15


class TokenizerLanes:
    def __init__(self, threads: int = 4):
        small = max(1, threads // 2)
        self._small = ThreadPoolExecutor(small, thread_name_prefix="nanoinfer-tokenize")
        self._large = ThreadPoolExecutor(max(1, threads - small), thread_name_prefix="nanoinfer-tokenize-large")

    def submit(self, size: int, fn, *args, **kwargs) -> asyncio.Future:
        """fn(*args, **kwargs) in a worker thread of the lane for a job of `size` characters."""
        lane = self._small if size <= SMALL_JOB_CHARS else self._large
        return asyncio.get_running_loop().run_in_executor(lane, partial(fn, *args, **kwargs))

    async def map(self, fn, items: list, sizes: list[int]) -> list:
        """[fn(x) for x in items] in jobs of at most SMALL_JOB_CHARS characters, one after another."""
        out, chunk, chunk_size = [], [], 0
        for item, size in zip(items, sizes):
            if chunk and chunk_size + size > SMALL_JOB_CHARS:
                out += await self.submit(chunk_size, _apply, fn, chunk)
                chunk, chunk_size = [], 0
            chunk.append(item)
            chunk_size += size
        if chunk:
            out += await self.submit(chunk_size, _apply, fn, chunk)
        return out

    def shutdown(self):
        for lane in (self._small, self._large):
            lane.shutdown(wait=False, cancel_futures=True)


def _apply(fn, items: list) -> list:
    return [fn(item) for item in items]
