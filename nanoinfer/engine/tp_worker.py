"""Tensor parallelism across processes. Rank 0 is a ModelRunner in the user's process; ranks 1..N-1
are spawned processes, each running a ModelRunner in a loop. `TensorParallelRunner` stands in for
rank 0's ModelRunner in the engine and drives the workers.

Rank 0 -> workers: one shared-memory segment per engine holding a length-prefixed pickle of
(method, args), and one semaphore per worker, released once per call (never blocking rank 0, unlike
an Event, whose set() waits for every sleeping waiter to wake: forever for a stopped worker). Workers -> rank 0: one pipe
per worker, on which it answers every call with ("ok", result) or ("error", traceback) before it
exits. The buffer is written again only after every worker has answered the call before, so a
worker never reads a half-written call. A call that outgrows the buffer moves everyone to a larger
segment first. A step sends its StepInput (engine/step_message.py): per row, the start position,
the token ids to compute and the block table. Sampling stays on rank 0.

Failure: rank 0 waits on the workers' pipes and process sentinels together, so a worker that dies
or raises is noticed at once; the engine then stops every worker, frees the segment and raises a
RuntimeError that carries the worker's error. On CPU (gloo) a dead peer also makes rank 0's pending
collective fail at once; on CUDA (NCCL) a watchdog thread aborts the process group to free it.
A worker that does not answer a step within NANOINFER_TP_STEP_TIMEOUT_S seconds (default 60: stopped
with SIGSTOP, or hung) is killed by the same watchdog, which turns it into a dead worker: the error
names the rank and the timeout, and the engine refuses further use.
"""
import atexit
import logging
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import struct
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_ready
from multiprocessing.shared_memory import SharedMemory

import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.engine.model_runner import InFlight, ModelRunner
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.step_message import StepInput

logger = logging.getLogger("nanoinfer")

SHM_INITIAL_BYTES = 1 << 20
SETTLE_TIMEOUT_S = 2.0       # how long a failed or interrupted step waits for the workers to finish it
EXIT_TIMEOUT_S = 10.0        # polite exit, then SIGTERM, then SIGKILL
PARENT_POLL_S = 0.5          # how often an idle worker checks that rank 0's process is alive
STEP_TIMEOUT_ENV = "NANOINFER_TP_STEP_TIMEOUT_S"
DEFAULT_STEP_TIMEOUT_S = 60.0  # a worker silent this long on a step is stuck (raise it for slow steps)
_HEADER = struct.Struct("<Q")  # payload length
_TIMED_CALLS = {"execute", "_ping", "_remap"}  # calls the step timeout applies to
_MAX_ERROR_CHARS = 16000     # a worker's traceback must fit the pipe buffer: it sends, then exits


def step_timeout() -> float:
    """Seconds a worker may take to answer a step: NANOINFER_TP_STEP_TIMEOUT_S, default 60."""
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


class WorkerFailure(Exception):
    """A worker died or raised; the message names the rank and carries its error."""


class _Timeout(Exception):
    """Workers alive but silent past a deadline (e.g. stuck in a collective rank 0 left)."""


# ---- the worker process ---------------------------------------------------------------------------
def _send_error(conn, rank: int):
    try:
        conn.send(("error", f"rank {rank}: {traceback.format_exc()[-_MAX_ERROR_CHARS:]}"))
    except Exception:
        pass


def worker_main(config: Config, rank: int, init_method: str, shm_name: str, calls, conn):
    """Ranks 1..N-1: wait for a call, run it on this rank's ModelRunner, answer, repeat until "exit"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    parent = mp.parent_process()
    try:
        shm = SharedMemory(name=shm_name)
        conn.send(("ok", None))  # started: about to join the process group
        runner = ModelRunner(config, rank, init_method)
        conn.send(("ok", runner.num_blocks))
        while True:
            if not calls.acquire(timeout=PARENT_POLL_S):
                if parent is not None and not parent.is_alive():
                    return  # rank 0 is gone (killed): nobody to serve
                continue
            (n,) = _HEADER.unpack_from(shm.buf, 0)
            method, args = pickle.loads(shm.buf[_HEADER.size:_HEADER.size + n])
            result = None
            if method == "execute":
                runner.execute(*args)
            elif method == "_remap":  # the call after this one is in a larger segment
                shm.close()
                shm = SharedMemory(name=args[0])
            elif method == "_ping":
                pass
            elif method == "exit":
                runner.exit()
                conn.send(("ok", None))
                shm.close()
                return
            else:
                result = getattr(runner, method)(*args)
            conn.send(("ok", result))
    except BaseException:
        _send_error(conn, rank)
        os._exit(1)  # no finalizers: a broken process group must not hold us up


# ---- rank 0 ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_reason(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}" if code is not None else "stopped answering"


class TensorParallelRunner:
    """Rank 0's ModelRunner plus the worker processes, behind ModelRunner's interface: `num_blocks`
    is the minimum over ranks, `allocate_kv_cache`, `run` and `exit` act on every rank; any other
    attribute is rank 0's."""

    def __init__(self, config: Config):
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (is another "
                               "tensor-parallel LLM alive? exit() it first); one process holds one TP engine")
        self.config = config
        self.world_size = n = config.tensor_parallel_size
        self.runner: ModelRunner | None = None
        self.procs, self.calls, self.conns = [], [], []  # per worker: process, call semaphore, answer pipe
        self._pending: set[int] = set()   # workers yet to answer the last call
        self._results: dict[int, object] = {}
        self._broken: str | None = None   # why the group can no longer be used
        self._closed = False
        self.step_timeout = step_timeout()
        self._deadline: float | None = None  # when the workers pending on a step count as stuck
        self._stuck: dict[int, str] = {}       # worker index -> why the watchdog killed it
        self._stop_watchdog = threading.Event()
        self._shm_base = f"nanoinfer_{os.getpid()}_{secrets.token_hex(6)}"
        self._shm_generation = 0
        self._segments: list[SharedMemory] = []
        atexit.register(self.exit)
        try:
            self.shm = self._new_segment(SHM_INITIAL_BYTES)
            self.init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            for rank in range(1, n):
                calls = ctx.Semaphore(0)
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, name=f"nanoinfer-tp{rank}", daemon=True,
                                   args=(config, rank, self.init_method, self.shm.name, calls, writer))
                self._start(proc)
                writer.close()
                self.procs.append(proc)
                self.calls.append(calls)
                self.conns.append(reader)
            self._pending = set(range(n - 1))
            self._collect("start-up")  # workers imported everything; none died on the way
            self._pending = set(range(n - 1))
            self.runner = ModelRunner(config, 0, self.init_method)  # joins the workers' process group
            worker_blocks = self._collect("model load")
            self.num_blocks = min([self.runner.num_blocks, *worker_blocks])
            threading.Thread(target=self._watchdog, name="nanoinfer-tp-watchdog", daemon=True).start()
            logger.info("tensor parallel: %d ranks (%s), KV blocks per rank min(%s) = %d", n,
                        "nccl" if config.device == "cuda" else "gloo",
                        [self.runner.num_blocks, *worker_blocks], self.num_blocks)
        except BaseException as e:
            failure = self._worker_failure_behind(e)
            # the workers serve no calls yet: stop them at once, without a polite exit (a prompt Ctrl-C)
            self._broken = failure or f"start-up failed ({type(e).__name__}: {e})"
            self.exit()
            if failure:
                raise RuntimeError(f"tensor-parallel worker failure during start-up: {failure}") from e
            raise

    def _worker_failure_behind(self, error: BaseException) -> str | None:
        """A start-up error on rank 0 (e.g. a collective losing its peer) is usually a worker's."""
        if isinstance(error, WorkerFailure):
            return str(error)
        if isinstance(error, KeyboardInterrupt) or not self.procs:
            return None
        try:
            self._collect("start-up", timeout=1.0)
        except WorkerFailure as e:
            return str(e)
        except _Timeout:
            pass
        return None

    @staticmethod
    def _start(proc):
        """Start a worker with SIGINT ignored, so that a Ctrl-C while it imports does not kill it
        half-way: the parent handles Ctrl-C and stops the workers itself."""
        if threading.current_thread() is not threading.main_thread():
            return proc.start()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, previous)

    def __getattr__(self, name):  # anything else is rank 0's
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    # ---- ModelRunner interface ------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int):
        # every rank at once: CUDA-graph capture runs collectives
        self._guard(lambda: self.runner.allocate_kv_cache(num_blocks), "allocate_kv_cache", num_blocks)
        self._wait("allocate_kv_cache")
        self.num_blocks = num_blocks

    def launch(self, batch: ScheduledBatch, prev: InFlight | None) -> InFlight:
        """One step on every rank; rank 0 samples. The workers' answers are collected before the
        next call, not now: they finish with rank 0's last collective anyway. (No overlap across
        ranks yet: the engine processes each step right after launching it, so `prev` is None.)"""
        step = StepInput.from_batch(batch)
        return self._guard(lambda: self.runner.launch(batch, prev, step), "execute", step)

    def collect(self, inflight: InFlight):
        return self.runner.collect(inflight)

    def ping(self):
        """A round trip through the workers without a forward (measures the RPC cost)."""
        self._guard(lambda: None, "_ping")
        self._wait("_ping")

    def exit(self):
        if self._closed:
            return
        self._closed = True
        self._stop_watchdog.set()
        try:
            polite = False
            if not self._broken and self.procs and all(p.is_alive() for p in self.procs):
                try:
                    self._collect("the last call", timeout=SETTLE_TIMEOUT_S)
                    self._write("exit")
                    self._collect("exit", timeout=EXIT_TIMEOUT_S)
                    polite = True
                except (WorkerFailure, _Timeout):
                    pass
            self._stop_workers(EXIT_TIMEOUT_S if polite else 0.2)
        finally:
            try:
                if self.runner is not None:
                    self.runner.exit()
                elif dist.is_available() and dist.is_initialized():  # rank 0 failed after joining
                    dist.destroy_process_group()
            except Exception:
                logger.exception("destroying rank 0's process group failed")
            finally:
                for conn in self.conns:
                    conn.close()
                self.calls.clear()  # spawn-context semaphores live in /dev/shm until collected
                for shm in self._segments:
                    shm.close()
                    try:
                        shm.unlink()
                    except FileNotFoundError:
                        pass
                self._segments.clear()
                atexit.unregister(self.exit)

    # ---- calls ----------------------------------------------------------------------------------
    def _guard(self, local, method: str, *args):
        """Send a call to the workers, run rank 0's part, and keep the group consistent when either
        fails: a worker failure becomes a RuntimeError with its error; a rank-0 failure is
        re-raised, after stopping the workers if they cannot finish the call without rank 0."""
        if self._broken:
            raise RuntimeError(f"the tensor-parallel group is unusable: {self._broken}")
        if self._closed:
            raise RuntimeError("the tensor-parallel group has exited")
        try:
            self._collect("the previous call")  # its buffer may be overwritten only once all have read it
            if not all(p.is_alive() for p in self.procs):  # died since: fail before touching a collective
                raise WorkerFailure(self._describe_failures({}))
            self._write(method, *args)
        except WorkerFailure as e:
            self._fail(str(e), None)
        try:
            return local()
        except BaseException as e:
            self._settle(e)
            raise

    def _settle(self, error: BaseException):
        """Rank 0 failed during a call. Raise a RuntimeError if a worker failed too (the likely
        cause); else give the workers a moment to finish the call, and stop them if they can't."""
        in_sync = False
        try:
            self._collect("the failed call", timeout=SETTLE_TIMEOUT_S)
            in_sync = True
        except WorkerFailure as e:
            self._fail(str(e), error)
        except _Timeout:
            pass
        finally:
            if not in_sync and not self._closed:
                self._broken = f"rank 0 failed during a call ({type(error).__name__}: {error})"
                self.exit()

    def _wait(self, what: str) -> list:
        try:
            return self._collect(what)
        except WorkerFailure as e:
            self._fail(str(e), None)

    def _fail(self, message: str, cause: BaseException | None):
        self._broken = message
        self.exit()
        raise RuntimeError(f"tensor-parallel worker failure: {message}") from cause

    def _new_segment(self, size: int) -> SharedMemory:
        shm = SharedMemory(name=f"{self._shm_base}_{self._shm_generation}", create=True, size=size)
        self._shm_generation += 1
        self._segments.append(shm)
        return shm

    def _write(self, method: str, *args):
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        if _HEADER.size + len(data) > self.shm.size:
            self._grow(_HEADER.size + len(data))
        buf = self.shm.buf
        _HEADER.pack_into(buf, 0, len(data))
        buf[_HEADER.size:_HEADER.size + len(data)] = data
        self._pending = set(range(len(self.procs)))
        self._deadline = time.monotonic() + self.step_timeout if method in _TIMED_CALLS else None
        for calls in self.calls:
            calls.release()

    def _grow(self, needed: int):
        new = self._new_segment(max(2 * self.shm.size, 1 << (needed - 1).bit_length()))
        self._write("_remap", new.name)  # small: it fits the current segment
        self._collect("_remap")
        old, self.shm = self.shm, new
        self._segments.remove(old)
        old.close()
        old.unlink()

    def _collect(self, what: str, timeout: float | None = None) -> list:
        """Wait for every pending worker's answer to the last call; raise WorkerFailure as soon as
        one reports an error or dies. Returns the results in rank order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            pending = sorted(self._pending)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            wait_ready([self.conns[i] for i in pending] + [self.procs[i].sentinel for i in pending],
                       timeout=1.0 if left is None else min(left, 1.0))
            for i in pending:
                conn = self.conns[i]
                if conn.poll():
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        raise WorkerFailure(self._describe_failures({})) from None
                    if status != "ok":
                        raise WorkerFailure(self._describe_failures({i: value}))
                    self._results[i] = value
                    self._pending.discard(i)
                elif not self.procs[i].is_alive():
                    raise WorkerFailure(self._describe_failures({}))
            if self._pending and deadline is not None and time.monotonic() >= deadline:
                raise _Timeout(f"rank(s) {[i + 1 for i in sorted(self._pending)]} did not answer "
                                    f"{what} within {timeout:.0f} s")
        results = [self._results.get(i) for i in range(len(self.procs))]
        self._results.clear()
        return results

    def _describe_failures(self, errors: dict[int, str]) -> str:
        """Every worker's error: the ones they sent, or how they ended. Waits up to 2 s for the
        others, which often fail right after the first (their collectives lose a peer)."""
        deadline = time.monotonic() + 2.0
        while len(errors) < len(self.procs) and time.monotonic() < deadline:
            for i, (conn, proc) in enumerate(zip(self.conns, self.procs)):
                if i in errors:
                    continue
                try:
                    while i not in errors and conn.poll():
                        status, value = conn.recv()
                        if status != "ok":
                            errors[i] = value
                except (EOFError, OSError):
                    proc.join(1.0)
                    errors[i] = self._stuck.get(i) or f"rank {i + 1}: process {proc.pid} {_exit_reason(proc)}"
            if len(errors) < len(self.procs):
                time.sleep(0.05)
        if not errors:
            return "no worker reported an error"
        return "\n".join(errors[i].rstrip() for i in sorted(errors))

    # ---- lifecycle ------------------------------------------------------------------------------
    def _stop_workers(self, grace: float):
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def _watchdog(self):
        """Kill a worker that leaves a step unanswered past the step timeout (stopped or hung): rank 0,
        blocked in a collective with it or waiting for its answer, then fails as for a dead worker.
        CUDA: a peer that dies leaves rank 0 blocked in an NCCL kernel; aborting the process group
        makes the blocked call fail, and the failure path reports the worker's error."""
        sentinels = [p.sentinel for p in self.procs]
        silent_before: set[int] = set()
        while not self._stop_watchdog.is_set():
            if wait_ready(sentinels, timeout=0.5) and not self._stop_watchdog.is_set():
                if self.config.device == "cuda":
                    logger.error("a tensor-parallel worker died; aborting the process group")
                    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                    try:
                        if abort is not None:
                            abort()
                    except Exception:
                        logger.exception("aborting the process group failed")
                return
            deadline = self._deadline
            silent = set()
            if deadline is not None and time.monotonic() > deadline:
                try:
                    silent = {i for i in list(self._pending) if not self.conns[i].poll()}
                except (OSError, ValueError):  # closed by exit()
                    return
            stuck = silent & silent_before  # silent on two looks in a row: not an answer being read
            silent_before = silent
            if stuck and not self._stop_watchdog.is_set():
                for i in sorted(stuck):
                    proc = self.procs[i]
                    self._stuck[i] = (f"rank {i + 1}: process {proc.pid} did not answer a step within "
                                      f"{self.step_timeout:g} s (stopped or hung; {STEP_TIMEOUT_ENV} sets the "
                                      "limit), so it was killed")
                    logger.error("%s", self._stuck[i])
                    proc.kill()
