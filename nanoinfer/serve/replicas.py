"""Data-parallel serving (`--data-parallel-size N`): N engine replicas behind one HTTP front end.

ReplicaSet is what the app serves from: EngineClient's interface (submit, abort, cut_all, the
/stats counters), over one EngineClient per replica, each its own engine process with its own
tensor-parallel group and devices (data_parallel/devices.py). The router (router.py) picks each
submission's replica; all of a submission's prompts and samples go to that one.

A replica whose process dies fails only its own requests (its client raises EngineDeadError: a 503,
or an error event in a stream). A watcher on the event loop notices it, the router stops sending it
requests and forgets its cached prefixes, and a background thread starts a new engine process for it,
retrying with growing pauses if that fails; each step is logged. `stop` / `close` end every replica,
those being restarted included.
"""
import asyncio
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nanoinfer.data_parallel.devices import check_data_parallel_size, replica_envs
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.process.engine_client import EngineClient, EngineDeadError, Submission
from nanoinfer.serve.metrics import ServerMetrics
from nanoinfer.serve.router import PrefixAffinityRouter, prefix_token_ids

logger = logging.getLogger("nanoinfer.serve")

WATCH_INTERVAL_S = 0.2                 # how often the event loop looks for dead replicas
RESTART_PAUSES_S = (1, 2, 5, 10, 30)   # between failed restarts of a replica (then the last, again)


@dataclass
class Replica:
    index: int
    env: dict
    client: EngineClient | None        # None while it is restarted
    starting: EngineClient | None = None  # the client being built by a restart
    restarts: int = 0
    # the counters of its previous engine processes
    finished_before: int = 0
    prompt_tokens_before: int = 0
    generation_tokens_before: int = 0

    @property
    def serving(self) -> bool:
        return self.client is not None and self.client.alive

    def retire(self, client: EngineClient):
        self.finished_before += client.num_finished
        self.prompt_tokens_before += client.prompt_tokens
        self.generation_tokens_before += client.generation_tokens


class ReplicaSet:
    """The app's engine with --data-parallel-size N: N replicas, a router, their restarts."""

    def __init__(self, model: str, options: dict, log_level: str, data_parallel_size: int, backend: str = "mp"):
        """backend: "mp", replicas are processes of this machine; "ray", Ray actors on a Ray cluster,
        each with the devices Ray gives it (data_parallel/ray_replica.py)."""
        self._args = (model, options, log_level)
        if backend == "ray":
            try:
                from nanoinfer.data_parallel.ray_replica import RayEngineClient  # optional dependency (ray)
            except ImportError as e:
                raise ValueError(f"data_parallel_backend='ray' needs Ray: pip install 'nanoinfer[ray]' ({e})") from None
            self._client_type, envs = RayEngineClient, [{}] * check_data_parallel_size(data_parallel_size)
        elif backend == "mp":
            self._client_type, envs = EngineClient, replica_envs(data_parallel_size, options)
        else:
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {backend!r}")
        clients = []
        try:  # every engine process starts at once; then each is waited for
            for env in envs:
                clients.append(self._client_type(model, options, log_level, env=env, wait=False))
            for client in clients:
                client.wait_ready()
        except BaseException:
            _each(clients, "close")
            raise
        first = clients[0]
        self.model, self.max_model_len, self.tokenizer = first.model, first.max_model_len, first.tokenizer
        self.summary = dict(first.summary, data_parallel_size=len(clients))
        self.replicas = [Replica(i, env, client) for i, (env, client) in enumerate(zip(envs, clients))]
        self.router = PrefixAffinityRouter(len(clients), first.summary["block_size"])
        self._metrics: ServerMetrics | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task | None = None
        self._lock = threading.Lock()  # _stopping vs. a restart starting a process
        self._stopping = False
        self._stopped = threading.Event()  # wakes a restart pausing between attempts

    # ---- the app's engine interface -------------------------------------------------------------
    @property
    def metrics(self) -> ServerMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: ServerMetrics | None):
        self._metrics = metrics
        for r in self.replicas:
            if r.client is not None:
                r.client.metrics = metrics.for_engine(r.index) if metrics else None

    def start(self):
        self._loop = asyncio.get_running_loop()
        for r in self.replicas:
            r.client.start()
        self._watcher = self._loop.create_task(self._watch())

    @property
    def alive(self) -> bool:
        """Some replica serves."""
        return not self._stopping and any(r.serving for r in self.replicas)

    async def submit(self, prompts: list, params: SamplingParams, stream: bool, priority: int = 0,
                     lora_request=None) -> Submission:
        keys = self.router.prefix_keys(prefix_token_ids(prompts[0])) if prompts else []
        loads = [r.client.outstanding_tokens if r.serving else None for r in self.replicas]
        index = self.router.choose(keys, loads)
        if index is None or self._stopping:
            raise EngineDeadError("no engine replica is running")
        self.router.record(keys, index)  # before the await: the next request with this prefix follows it
        return await self.replicas[index].client.submit(prompts, params, stream, priority=priority,
                                                             lora_request=lora_request)

    def abort(self, sub: Submission):
        for r in self.replicas:  # (only the client that owns it acts)
            if r.client is not None:
                r.client.abort(sub)

    def cut_all(self, message: str):
        for r in self.replicas:
            if r.client is not None:
                r.client.cut_all(message)

    @property
    def num_requests(self) -> int:
        return sum(r.client.num_requests for r in self.replicas if r.client is not None)

    @property
    def num_finished(self) -> int:
        return sum(r.finished_before + (r.client.num_finished if r.client else 0) for r in self.replicas)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens_before + (r.client.prompt_tokens if r.client else 0) for r in self.replicas)

    @property
    def generation_tokens(self) -> int:
        return sum(r.generation_tokens_before + (r.client.generation_tokens if r.client else 0)
                   for r in self.replicas)

    def replica_stats(self) -> list[dict]:
        """/stats' `replicas`: per replica, its requests now and finished since start (over its
        restarts), whether it serves, and how often it was restarted."""
        return [{"requests_running": r.client.num_requests if r.client else 0,
                 "requests_finished": r.finished_before + (r.client.num_finished if r.client else 0),
                 "alive": r.serving, "restarts": r.restarts} for r in self.replicas]

    def stop(self):
        """Abort what is left and end every replica's engine process, in parallel."""
        self._end("stop")

    def close(self):
        self._end("close")

    def _end(self, how: str):
        with self._lock:
            self._stopping = True
            self._stopped.set()
            clients = [c for r in self.replicas for c in (r.client, r.starting) if c is not None]
        if self._watcher is not None:
            self._watcher.cancel()
        _each(clients, how)

    # ---- failures and restarts ------------------------------------------------------------------
    async def _watch(self):
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for r in self.replicas:
                if r.client is not None and not r.client.alive and not self._stopping:
                    self._replace(r)

    def _replace(self, r: Replica):
        """On the event loop: take the dead replica out of service (its requests have failed with
        its client) and restart it in the background."""
        dead, r.client = r.client, None
        r.retire(dead)
        self.router.forget(r.index)
        logger.error("data-parallel replica %d stopped (%s); restarting it", r.index, dead.error or "exited")
        threading.Thread(target=self._restart, args=(r, dead), name=f"nanoinfer-restart-{r.index}",
                         daemon=True).start()

    def _restart(self, r: Replica, dead: EngineClient):
        """In a background thread: build the replica's new engine, retrying until it starts or the
        server stops."""
        dead.close()
        for attempt in itertools.count():
            with self._lock:
                if self._stopping:
                    return
                client = r.starting = self._client_type(*self._args, env=r.env, wait=False)
            try:
                client.wait_ready()
            except Exception as e:
                r.starting = None
                pause = RESTART_PAUSES_S[min(attempt, len(RESTART_PAUSES_S) - 1)]
                if not self._stopping:
                    logger.error("data-parallel replica %d failed to restart (%s: %s); retrying in %d s",
                                 r.index, type(e).__name__, e, pause)
                if self._stopped.wait(pause):
                    return
                continue
            try:
                self._loop.call_soon_threadsafe(self._restarted, r, client)
            except RuntimeError:  # the event loop has closed: the server is gone
                client.close()
            return

    def _restarted(self, r: Replica, client: EngineClient):
        """On the event loop: the new engine serves."""
        with self._lock:
            r.starting = None
            if self._stopping:  # (stop() has closed it: it was r.starting)
                return
        client.metrics = self._metrics.for_engine(r.index) if self._metrics else None
        client.start()
        r.client = client
        r.restarts += 1
        logger.warning("data-parallel replica %d restarted (engine process %d)", r.index, client.process.pid)


def _each(clients: list[EngineClient], how: str):
    """client.how() for every client at once (each may take seconds)."""
    if clients:
        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(lambda client: getattr(client, how)(), clients))
