"""`--data-parallel-backend ray`: each replica's engine process runs on a node of a Ray cluster.

A replica is a Ray actor (EngineHost) placed by its own placement group, one bundle holding the
replica's GPUs (tensor_parallel_size of them: its tensor-parallel ranks are processes of one node) and
a CPU. The actor starts the usual engine process (engine_process.py) on its node, which inherits the
CUDA_VISIBLE_DEVICES Ray gives the actor, and relays that process's two pipes. On the front end,
RayEngineClient is the EngineClient whose pipes and process are the actor's: the engine protocol,
the router and the restarts are the same as with local processes. Ray does the placing and the
transport; a node lost is an actor lost, which fails that replica's requests, and its restart waits
for Ray to place it again.
"""
import os
from collections import deque

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nanoinfer.process.engine_client import EngineClient
from nanoinfer.process.engine_launch import end_engine_process, launch_engine_process
from nanoinfer.process.messages import Ready, StartFailed

PLACEMENT_TIMEOUT_S = float(os.environ.get("NANOINFER_RAY_PLACEMENT_TIMEOUT", 600))


class EngineHost:
    """The Ray actor: one replica's engine process on the node Ray placed it on, and its pipes.
    Threaded (max_concurrency): `recv` waits while `send` and `close` are called."""

    def __init__(self, model: str, options: dict, log_level: str):
        self.process, self.commands, self.events = launch_engine_process(model, options, log_level, {})

    def send(self, commands: list):
        self.commands.send(commands)

    def recv(self) -> list:
        """The engine's next messages, waiting for one; EOFError once the engine is gone."""
        messages = [self.events.recv()]
        try:
            while self.events.poll():
                messages.append(self.events.recv())
        except EOFError:
            pass  # the next call raises it
        return messages

    def join(self, timeout: float | None) -> int | None:
        """The engine process's exit code, once it has exited within `timeout`; else None."""
        self.process.join(timeout)
        return self.process.exitcode

    def close(self, timeout: float):
        end_engine_process(self.process, timeout)


class _ActorPipes:
    """The actor's pipes as EngineClient uses its own: send (OSError when the actor is gone) and
    recv (EOFError)."""

    def __init__(self, actor):
        self.actor, self.received = actor, deque()

    def send(self, commands: list):
        try:
            ray.get(self.actor.send.remote(commands))  # (waited for: commands keep their order)
        except RayError as e:
            raise OSError(f"the engine actor is gone: {e}") from None

    def recv(self):
        if not self.received:
            try:
                self.received.extend(ray.get(self.actor.recv.remote()))
            except RayError:  # the engine process or the actor (its node) is gone
                raise EOFError from None
        return self.received.popleft()


class _ActorProcess:
    """The remote engine process as EngineClient sees its process: alive until its pipe ends or it
    is ended."""

    def __init__(self, actor):
        self.actor, self.alive, self.exitcode = actor, True, None

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None):
        if not self.alive:
            return
        try:
            self.exitcode = ray.get(self.actor.join.remote(timeout))
        except RayError:
            self.exitcode = -9  # the actor (or its node) died: its process went with it
        if self.exitcode is not None:
            self.alive = False


class RayEngineClient(EngineClient):
    """An EngineClient whose engine process runs in a Ray actor (connects to the Ray cluster, or
    starts a local one, on first use)."""

    def _launch(self, model: str, options: dict, log_level: str, env: dict):
        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        tp = options.get("tensor_parallel_size", 1)
        gpus = tp if _wants_gpus(options.get("device", "auto")) else 0
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
        self._placement = placement_group([bundle], strategy="STRICT_PACK")
        actor_type = ray.remote(EngineHost).options(
            num_cpus=1, num_gpus=gpus, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement))
        actor = self._actor = actor_type.remote(model, options, log_level)
        pipes = _ActorPipes(actor)
        return _ActorProcess(actor), pipes, pipes

    def _wait_ready(self) -> Ready:
        try:
            ray.get(self._placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(f"the Ray cluster could not place an engine replica ({self._placement.bundle_specs[0]}) "
                               f"within {PLACEMENT_TIMEOUT_S:g} s") from None
        try:
            message = self._events.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine actor exited (code {self.process.exitcode}) while starting") from None
        if isinstance(message, StartFailed):
            raise message.error.exception()
        return message

    def _end_process(self, timeout: float):
        if getattr(self, "_ended", False):  # (the reader, a failing thread and close() may each end it)
            return
        self._ended = True
        try:
            ray.get(self._actor.close.remote(timeout), timeout=3 * timeout)
        except RayError:
            pass  # gone already, or stuck: killed below
        ray.kill(self._actor)
        remove_placement_group(self._placement)
        self.process.alive = False


def _wants_gpus(device: str) -> bool:
    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return device == "cuda"
