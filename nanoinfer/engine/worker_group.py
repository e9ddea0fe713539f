"""Worker processes and their failure handling, apart from what they compute (engine/tp_executor.py).

Calls: the parent writes a call's payload into one shared-memory segment and sends each worker a
small message on its pipe; every worker answers every call on the same pipe with a Reply (a value,
or the traceback it failed with). The payload is written again only after every worker has answered the call
before, so nobody reads a half-written payload; a payload that outgrows the segment moves everyone
to a larger one first. Each segment's name is unlinked as soon as every worker has mapped it, and
pipes have no name: nothing is left in /dev/shm whatever happens to any process.

Failure: the parent waits on the pipes and the process sentinels together, so a worker that dies
or raises fails the call at once (WorkerFailure, naming the rank and carrying its error); so does a
call left unanswered past its timeout. Workers ignore Ctrl-C (the parent's to handle) and exit when
the parent's process is gone, even when stuck in a collective. The parent never joins a collective:
when a call fails it SIGKILLs the workers, which no stuck collective can delay.
"""
import logging
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from multiprocessing.shared_memory import SharedMemory

logger = logging.getLogger("nanoinfer")

INITIAL_SEGMENT_BYTES = 1 << 20
PARENT_POLL_S = 0.5           # how often a worker checks that its parent is alive
MAX_ERROR_CHARS = 16000      # a worker's traceback must fit the pipe buffer: it sends, then exits


class WorkerFailure(Exception):
    """A worker died, raised or stayed silent past a call's timeout; the message names the rank(s)."""


@dataclass(slots=True)
class Reply:
    """A worker's answer to a call: its value, or the error (a traceback) it ended with."""
    value: object = None
    error: str | None = None


@dataclass(slots=True)
class Remap:
    """The group's own call: map the larger shared-memory segment `segment`."""
    segment: str


# ---- the worker's end -----------------------------------------------------------------------------
class WorkerChannel:
    """A worker's end of the group: `recv()` the next call's message, `payload(span)` its data,
    `answer(value)`. Remapping to a larger segment is handled here."""

    def __init__(self, rank: int, conn, segment: str):
        self.rank, self.conn = rank, conn
        self._map(segment)

    def _map(self, name: str):
        self.shm = SharedMemory(name=name)  # (registered with the parent's tracker; the parent unlinks it)

    def recv(self):
        while True:
            message = self.conn.recv()
            if not isinstance(message, Remap):
                return message
            self.shm.close()
            self._map(message.segment)
            self.answer(None)

    def payload(self, span: tuple[int, int]) -> memoryview:
        start, length = span
        return self.shm.buf[start:start + length]

    def answer(self, value=None):
        self.conn.send(Reply(value))

    def close(self):
        self.shm.close()


def _worker_entry(target, rank: int, conn, segment: str, args: tuple):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (blocked while starting) for our children
    parent = os.getppid()

    def exit_with_parent():  # a thread: works while the main thread is stuck in a collective
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        channel = WorkerChannel(rank, conn, segment)
        target(channel, *args)
        channel.close()
    except BaseException:
        try:
            conn.send(Reply(error=f"rank {rank}: {traceback.format_exc()[-MAX_ERROR_CHARS:]}"))
        except Exception:
            pass
        os._exit(1)  # no finalizers: a broken process group must not hold us up


# ---- the parent's end -----------------------------------------------------------------------------
def _exit_reason(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}" if code is not None else "stopped answering"


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("T", "t")
    except OSError:
        return False


class WorkerGroup:
    """`n` spawned processes running target(channel, *args) for ranks 0..n-1 (`args_of(rank)`)."""

    def __init__(self, n: int, target, args_of, name: str):
        self.name = name
        self.procs, self.conns = [], []
        self._pending: set[int] = set()
        self._results: dict[int, object] = {}
        self._segments: list[SharedMemory] = []
        self._unlinked = False
        self.shm = self._new_segment(INITIAL_SEGMENT_BYTES)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(n):
                conn, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_entry, name=f"{name}{rank}", daemon=True,
                                   args=(target, rank, child, self.shm.name, args_of(rank)))
                self.conns.append(conn)
                # SIGINT blocked: the worker inherits the mask (a Ctrl-C while it imports must not
                # kill it half-way; it ignores SIGINT once running), and here a Ctrl-C arrives
                # once the worker is in self.procs, for stop() to find
                previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    self._start(proc)
                    self.procs.append(proc)
                    child.close()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        except BaseException:  # e.g. Ctrl-C while spawning
            self.stop(0.0)
            raise
        self._pending = set(range(n))  # each answers once it has mapped the segment and started

    @staticmethod
    def _start(proc):
        proc.start()

    # ---- calls ----------------------------------------------------------------------------------
    def call(self, messages: list, payload: bytes | None = None):
        """Send one message per worker (small, picklable), with `payload` in the segment at offset
        0 (messages refer to it by (start, length) spans). The previous call's answers must have
        been collected."""
        if self._pending:
            raise RuntimeError("a call was sent before the previous one was answered")
        if payload:
            if len(payload) > self.shm.size:
                self._grow(len(payload))
            self.shm.buf[:len(payload)] = payload
        for conn, message in zip(self.conns, messages):
            try:
                conn.send(message)
            except OSError:  # its end is closed: it died (wait() reports how)
                pass
        self._pending = set(range(len(self.procs)))

    def wait(self, what: str, timeout: float | None = None, exiting: bool = False) -> list:
        """Every worker's answer to the last call, in rank order. Raises WorkerFailure as soon as
        one reports an error or any dies (also one that has answered: on CUDA a rank answers once
        its step is queued, and its peers then wait for it on the device), or when some are silent
        at `timeout` seconds. `exiting`: the call ends the workers, who may exit once answered."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            pending = sorted(self._pending)
            left = 1.0 if deadline is None else max(min(deadline - time.monotonic(), 1.0), 0.0)
            wait_ready([self.conns[i] for i in pending] + [p.sentinel for p in self.procs], timeout=left)
            for i in pending:
                conn = self.conns[i]
                try:
                    ready = conn.poll()
                    if ready:
                        reply = conn.recv()
                except (EOFError, OSError):
                    raise WorkerFailure(self._describe({})) from None
                if ready:
                    if reply.error is not None:
                        raise WorkerFailure(self._describe({i: reply.error}))
                    self._results[i] = reply.value
                    self._pending.discard(i)
                elif not self.procs[i].is_alive():
                    raise WorkerFailure(self._describe({}))
            if not exiting and not all(p.is_alive() for p in self.procs):
                raise WorkerFailure(self._describe({}))
            if self._pending and deadline is not None and time.monotonic() >= deadline:
                raise WorkerFailure(self._describe_silent(what, timeout))
        results = [self._results.pop(i, None) for i in range(len(self.procs))]
        if not self._unlinked:  # every worker has mapped the first segment: its name can go
            self._unlink(self.shm)
            self._unlinked = True
        return results

    def _describe_silent(self, what: str, timeout: float) -> str:
        """The ranks that left the call unanswered. A stopped one (SIGSTOP) is the cause when there
        is one: its peers wait for it in a collective."""
        silent = [i for i in sorted(self._pending) if not self.conns[i].poll()]
        stopped = [i for i in silent if _is_stopped(self.procs[i].pid)]
        return "\n".join(f"rank {i}: process {self.procs[i].pid} did not answer {what} within {timeout:g} s "
                         f"({'stopped' if i in stopped else 'slow, hung, or waiting for a peer'})"
                         for i in (stopped or silent))

    def _describe(self, errors: dict[int, str]) -> str:
        """Every worker's error: the ones they sent, or how they ended. Waits up to 1 s for the
        others, which often fail right after the first (their collectives lose a peer)."""
        deadline = time.monotonic() + 1.0
        while len(errors) < len(self.procs) and time.monotonic() < deadline:
            for i, (conn, proc) in enumerate(zip(self.conns, self.procs)):
                if i in errors:
                    continue
                try:
                    while i not in errors and conn.poll():
                        reply = conn.recv()
                        if reply.error is not None:
                            errors[i] = reply.error
                except (EOFError, OSError):
                    proc.join(0.5)
                    errors[i] = f"rank {i}: process {proc.pid} {_exit_reason(proc)}"
            if len(errors) < len(self.procs):
                time.sleep(0.02)
        if not errors:
            return "no worker reported an error"
        return "\n".join(errors[i].rstrip() for i in sorted(errors))

    # ---- segments -------------------------------------------------------------------------------
    def _new_segment(self, size: int) -> SharedMemory:
        shm = SharedMemory(name=f"{self.name}_{os.getpid()}_{secrets.token_hex(6)}", create=True, size=size)
        self._segments.append(shm)
        return shm

    def _unlink(self, shm: SharedMemory):
        try:
            shm.unlink()
        except FileNotFoundError:
            pass

    def _grow(self, needed: int):
        new = self._new_segment(max(2 * self.shm.size, 1 << (needed - 1).bit_length()))
        self.call([Remap(new.name)] * len(self.procs))
        self.wait("a remap", timeout=30.0)
        old, self.shm = self.shm, new
        self._unlink(new)  # every worker has mapped it
        self._segments.remove(old)
        old.close()

    # ---- lifecycle ------------------------------------------------------------------------------
    def stop(self, grace: float):
        """Wait up to `grace` seconds for the workers to exit, then SIGKILL the rest; release
        the pipes and segments."""
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        for shm in self._segments:
            shm.close()
            self._unlink(shm)
        self._segments.clear()
        self._pending.clear()
