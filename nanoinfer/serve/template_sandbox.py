"""Request chat templates (untrusted code) rendered in sandbox processes, side by side.

One spawned "zygote" process imports what a render needs and renders once; for each request it
forks a child (a fork of a warm, single-threaded process takes milliseconds) that renders under a
memory and CPU limit, answers, and exits. The zygote kills a child at its request's time limit, so
a template bomb costs its own request alone: other renders run beside it (up to `max_renders` at
once; more wait for a free slot) and nothing is restarted on the request path.
"""
import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait

from nanoinfer.chat import render_chat

logger = logging.getLogger("nanoinfer.serve")

SANDBOX_MEMORY_BYTES = 2 << 30  # a render's heap beyond what the zygote uses
SANDBOX_START_S = 120.0  # a loaded machine imports transformers slowly


class TemplateSandbox:
    def __init__(self, tokenizer, max_output_chars: int, media=None, max_renders: int = 4):
        """media: the MediaLoader image content parts are read with (None: refused)."""
        self._args = (tokenizer, max_output_chars, media, max_renders)
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the pipe's sending end, and (re)starting the zygote
        self._closed = False
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_zygote_main, args=(theirs, *self._args), name="nanoinfer-template-sandbox",
                           daemon=True)
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, ours
        threading.Thread(target=self._read, args=(proc, ours), name="nanoinfer-sandbox-reader", daemon=True).start()

    async def render(self, kwargs: dict, timeout_s: float) -> dict:
        """render_chat(**kwargs) in a child of the zygote; ValueError for the template's errors and a
        render past `timeout_s` or the memory limit."""
        future: Future = Future()
        rid = next(self._ids)
        self._pending[rid] = future
        try:
            # (the pipe holds it while the zygote starts; the zygote answers every render: its
            # answer, its death, or its time limit; if the zygote dies, the reader fails its renders)
            await asyncio.to_thread(self._send, rid, kwargs, timeout_s)
            ok, value = await asyncio.wrap_future(future)
        finally:
            self._pending.pop(rid, None)
        if ok:
            return value
        raise ValueError(value)

    def _send(self, rid: int, kwargs: dict, timeout_s: float):
        with self._lock:
            try:
                self._conn.send((rid, kwargs, timeout_s))
            except (OSError, ValueError) as e:  # it died meanwhile: the reader starts another
                self._answer(rid, (False, f"the template sandbox stopped ({type(e).__name__})"))

    def _read(self, proc, conn):
        """This zygote's answers, until it ends; then the renders it had fail, and another starts."""
        try:
            # its start (imports, a first render) is not a template's time, but it is bounded
            if conn.poll(SANDBOX_START_S) and conn.recv() == "ready":
                while True:
                    rid, ok, value = conn.recv()
                    self._answer(rid, (ok, value))
        except (EOFError, OSError, TypeError, ValueError):
            pass
        if not self._closed:
            logger.warning("the template sandbox stopped or did not start; starting another")
            self._restart(proc)

    def _answer(self, rid: int, answer: tuple):
        future = self._pending.get(rid)
        if future is not None and not future.done():
            future.set_result(answer)

    def _restart(self, proc):
        proc.kill()  # first: a send blocked on its pipe (holding the lock) fails now
        with self._lock:
            if self._closed or proc is not self._proc:
                return  # closed, or replaced already
            _end(proc, self._conn)
            for rid in list(self._pending):
                self._answer(rid, (False, "the template sandbox stopped"))
            self._start()

    def close(self):
        self._closed = True
        self._proc.kill()
        with self._lock:
            _end(self._proc, self._conn)


def _end(proc, conn):
    """Kill the zygote (its children die with it: PR_SET_PDEATHSIG) and close its pipe."""
    proc.kill()
    proc.join(5)
    conn.close()


def _zygote_main(conn, tokenizer, max_output_chars: int, media, max_renders: int):
    """Fork a child per render (at most max_renders at once), answer (rid, ok, value) for each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when it stops (and kills it)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a forked child must not wait on the parent's pool
    try:  # warm up: the first render imports and compiles what every render needs
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] }}")
    except Exception:
        pass
    conn.send("ready")
    queued: deque = deque()
    children: dict = {}  # the child's answer pipe -> (rid, pid, deadline, time limit)
    while True:
        now = time.monotonic()
        timeout = max(0.0, min((c[2] for c in children.values()), default=now + 60) - now)
        for ready in wait([conn, *children], timeout):
            if ready is conn:
                try:
                    queued.append(conn.recv())
                except (EOFError, OSError):  # the server is gone: so are the renders
                    for child in children.values():
                        _kill(child[1])
                    return
            else:
                rid, pid, _, _ = children.pop(ready)
                try:
                    answer = ready.recv()
                except (EOFError, OSError):  # it died: its heap limit, most likely
                    answer = (False, "the chat template exhausted the renderer's memory")
                ready.close()
                _kill(pid)
                conn.send((rid, *answer))
        now = time.monotonic()
        for child, (rid, pid, deadline, timeout_s) in list(children.items()):
            if now >= deadline:
                del children[child]
                child.close()
                _kill(pid)
                conn.send((rid, False, f"the chat template did not finish rendering within {timeout_s:g} s"))
        while queued and len(children) < max_renders:
            rid, kwargs, timeout_s = queued.popleft()
            ours, theirs = mp.Pipe(duplex=False)  # (receiving end, sending end)
            pid = os.fork()
            if pid == 0:
                ours.close()
                _child(theirs, kwargs, timeout_s, tokenizer, max_output_chars, media)
            theirs.close()
            children[ours] = (rid, pid, time.monotonic() + timeout_s, timeout_s)


def _child(conn, kwargs: dict, timeout_s: float, tokenizer, max_output_chars: int, media):
    """A forked child: render, answer, exit (never returning into the zygote's loop)."""
    try:
        _limit(timeout_s)
        answer = (True, render_chat(tokenizer, max_output_chars=max_output_chars, media=media, **kwargs))
    except MemoryError:
        answer = (False, "the chat template exhausted the renderer's memory")
    except (ValueError, TypeError) as e:
        answer = (False, str(e))
    except BaseException as e:  # render_chat wraps the template's errors; anything else is still the request's
        answer = (False, f"the chat template failed: {type(e).__name__}")
    try:
        conn.send(answer)
    except BaseException:
        pass
    os._exit(0)


def _kill(pid: int):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _limit(timeout_s: float):
    """Cap this child's data segment at what it uses now + SANDBOX_MEMORY_BYTES, its CPU time past
    its time limit (a backstop: the zygote kills it at the limit), and end it with the zygote."""
    try:  # (Unix only: inside the try, so a platform without them runs the child unlimited)
        import ctypes
        import resource
        with open(f"/proc/{os.getpid()}/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + SANDBOX_MEMORY_BYTES, resource.RLIM_INFINITY))
        cpu = int(timeout_s) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (ImportError, OSError, StopIteration, ValueError, AttributeError) as e:  # not Linux: the time limit holds
        logger.warning("the template sandbox runs without a memory limit: %s", e)
