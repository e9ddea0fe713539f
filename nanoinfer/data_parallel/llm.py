"""`LLM(model, data_parallel_size=N, **options)`: generate() and chat() split their prompts over N
engines, each in its own process with its own devices (as the server's replicas: the same engine
process and EngineClient), and return the outputs in prompt order. DataParallelEngines is the
backend that such an LLM hands its generate() to (nanoinfer/__init__.py registers it).

The prompts are cut into N contiguous runs of about equal length (neighbouring prompts, which often
share a prefix, stay on one engine's prefix cache). The engine clients live on an event loop in a
background thread, so generate() is a plain blocking call, from a notebook too. As LLM.generate,
every prompt is validated before any runs: if one engine refuses its part, the parts already queued
elsewhere are aborted and the error is raised.
"""
import asyncio
import atexit
import itertools
import threading

from tqdm.auto import tqdm

from nanoinfer.config import Config
from nanoinfer.data_parallel.devices import check_data_parallel_size, replica_envs
from nanoinfer.priority.order import check_priorities
from nanoinfer.outputs import RequestOutput
from nanoinfer.process.engine_client import EngineClient
from nanoinfer.utils.main_guard import check_main_guard


class DataParallelEngines:
    """N engine processes behind an LLM(model, data_parallel_size=N > 1): its generate() (and so
    chat()) and exit(). (stream() and the step-by-step engine API need one engine.)"""
    check_size = staticmethod(check_data_parallel_size)

    def __init__(self, model: str, data_parallel_size: int, **options):
        self.config = Config.from_options(model, **options)  # bad options raise here, before any process
        envs = replica_envs(data_parallel_size, options)
        check_main_guard(f"data_parallel_size={len(envs)}")
        self.tokenizer = None
        self._clients: list[EngineClient] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nanoinfer-data-parallel", daemon=True)
        self._request_ids = itertools.count()
        try:  # every engine process starts at once; then each is waited for
            for env in envs:
                self._clients.append(EngineClient(self.config.model, options, "warning", env=env, wait=False))
            for client in self._clients:
                client.wait_ready()
        except BaseException:
            for client in self._clients:
                client.close()
            raise
        self.tokenizer = self._clients[0].tokenizer
        self._thread.start()
        self._run(self._start())
        atexit.register(self.exit)

    @property
    def data_parallel_size(self) -> int:
        return len(self._clients)

    def generate(self, prompts: list, params: list, use_tqdm=True, loras: list | None = None,
                 priority=None) -> list[RequestOutput]:
        """LLM.generate's, its prompts and params one per prompt (as LLM._normalize makes them);
        request ids are numbered across the engines, in prompt order. Each engine orders its own
        share of the prompts by `priority`."""
        priorities = check_priorities(priority, len(prompts), self.config.scheduling_policy)
        loras = loras or [None] * len(prompts)
        if self._exited:
            raise RuntimeError("this engine has exited; create a new LLM")
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(prompts), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            outputs = self._run(self._generate(prompts, params, priorities, loras, bar.update if use_tqdm else None))
        finally:
            bar.close()
        for out in outputs:
            out.request_id = next(self._request_ids)
        return outputs

    def exit(self):
        """End every engine process (their workers and shared memory go with them)."""
        if self._exited:
            return
        for client in self._clients:
            client.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        atexit.unregister(self.exit)

    @property
    def _exited(self) -> bool:
        return not self._thread.is_alive()

    # ---- on the event loop ----------------------------------------------------------------------
    async def _start(self):
        for client in self._clients:
            client.start()

    async def _generate(self, prompts: list, params: list, priorities: list[int], loras: list,
                        progress) -> list[RequestOutput]:
        parts = _split(len(prompts), len(self._clients))
        subs = []
        try:
            for client, (start, end) in zip(self._clients, parts):
                for lo, hi in _same_request_runs(params, priorities, loras, start, end):  # one submission a run
                    subs.append((lo, await client.submit(prompts[lo:hi], params[lo], stream=False,
                                                         max_tokens_must_fit=False, priority=priorities[lo],
                                                         lora_request=loras[lo])))
            outputs: list[RequestOutput | None] = [None] * len(prompts)

            async def collect(lo, sub):
                async for i, event in sub.results():
                    if isinstance(event, RequestOutput):
                        outputs[lo + i] = event
                        if progress is not None:
                            progress(1)

            await asyncio.gather(*(collect(lo, sub) for lo, sub in subs))
            return outputs
        finally:  # an error, or the caller interrupted: nothing of this call keeps running
            for client in self._clients:
                for _, sub in subs:
                    client.abort(sub)

    def _run(self, coroutine):
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:  # (KeyboardInterrupt too: the coroutine is cancelled and aborts its requests)
            future.cancel()
            raise


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous runs of about count / parts items."""
    bounds = [count * i // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def _same_request_runs(params: list, priorities: list[int], loras: list, start: int, end: int) -> list[tuple[int, int]]:
    """[lo, hi) runs within [start, end) whose prompts share one SamplingParams object, priority and
    adapter (one engine submission each)."""
    runs, lo = [], start
    for i in range(start + 1, end + 1):
        if i == end or params[i] is not params[lo] or priorities[i] != priorities[lo] or loras[i] != loras[lo]:
            runs.append((lo, i))
            lo = i
    return runs
