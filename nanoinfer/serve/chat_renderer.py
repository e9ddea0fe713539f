"""Chat prompts rendered off the HTTP event loop, each render bounded in time and output size.

The checkpoint's own template is the operator's choice: it renders in a worker thread, and a
render past the time limit fails its request (the thread ends by itself; its work grows only with
the request, which the body limit bounds). A template sent in a request (`chat_template`) is
untrusted code: refused unless the server runs with --trust-request-chat-template, and then
rendered in a sandbox process with a memory limit, which is killed (and replaced) when a render
runs past the time limit, so that a template bomb costs its request alone.
"""
import asyncio
import logging
import multiprocessing as mp
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from nanoinfer.utils.chat import render_chat

logger = logging.getLogger("nanoinfer.serve")

SANDBOX_MEMORY_BYTES = 2 << 30  # the sandbox process's heap beyond what it uses at start
SANDBOX_START_S = 120.0  # a loaded machine imports transformers slowly


class RenderRefused(ValueError):
    """A request's template was refused (the server does not trust request templates)."""


class ChatRenderer:
    def __init__(self, tokenizer, trust_request_templates: bool = False, timeout_s: float = 5.0,
                 max_output_chars: int = 1 << 22, threads: int = 4, media=None):
        """media: the multimodal.media.MediaLoader that reads image content parts (None: refused)."""
        self.tokenizer = tokenizer
        self.media = media
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.trust_request_templates = trust_request_templates
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="nanoinfer-render")
        self._sandbox = TemplateSandbox(tokenizer, max_output_chars, media) if trust_request_templates else None

    async def render(self, messages, chat_template: str | None = None, **options) -> dict:
        """render_chat's {"prompt", "prompt_token_ids"}; ValueError / TypeError for bad input, a
        template error, a render past the limits, or a refused request template."""
        if chat_template is not None:
            if self._sandbox is None:
                raise RenderRefused("a chat_template in the request is refused: the server runs the model's own "
                                    "template unless it was started with --trust-request-chat-template")
            return await self._sandbox.render(dict(options, messages=messages, chat_template=chat_template),
                                              self.timeout_s)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._threads, partial(render_chat, self.tokenizer, messages,
                                                           max_output_chars=self.max_output_chars,
                                                           media=self.media, **options))
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"the chat template did not finish rendering within {self.timeout_s:g} s") from None

    async def tokenize(self, prompts: list) -> list:
        """Text prompts as {"prompt", "prompt_token_ids"} (token-id prompts as they are), encoded in
        the worker threads: a long prompt's tokenization holds up neither the event loop nor the
        engine's steps."""
        if not any(isinstance(p, str) for p in prompts):
            return prompts
        from nanoinfer.engine.detokenizer import encode  # the engine's own encoding of a text prompt

        def run():
            return [{"prompt": p, "prompt_token_ids": encode(self.tokenizer, p)} if isinstance(p, str) else p
                    for p in prompts]
        return await asyncio.get_running_loop().run_in_executor(self._threads, run)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.tokenizer.decode, token_ids)

    def close(self):
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()


class TemplateSandbox:
    """One spawned process that renders request templates, one at a time; replaced when killed."""

    def __init__(self, tokenizer, max_output_chars: int, media=None):
        """media: the MediaLoader the sandbox reads image content parts with (None: refused)."""
        self.tokenizer, self.max_output_chars, self.media = tokenizer, max_output_chars, media
        self._lock = asyncio.Lock()
        self._guard = threading.Lock()
        self._proc = self._conn = None
        self._start()

    def _start(self):
        with self._guard:
            ctx = mp.get_context("spawn")
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_sandbox_main, args=(theirs, self.tokenizer, self.max_output_chars, self.media),
                               name="nanoinfer-template-sandbox", daemon=True)
            proc.start()
            theirs.close()
            self._proc, self._conn, self._ready = proc, ours, False

    async def render(self, kwargs: dict, timeout_s: float) -> dict:
        async with self._lock:  # one render at a time: the pipe carries one request and its answer
            return await asyncio.get_running_loop().run_in_executor(None, self._render, kwargs, timeout_s)

    def _render(self, kwargs: dict, timeout_s: float) -> dict:
        conn = self._conn
        try:
            if not self._ready:  # its start (imports, a first render) is not the template's time
                if not conn.poll(SANDBOX_START_S):
                    self._replace()
                    raise ValueError("the template sandbox did not start")
                conn.recv()
                self._ready = True
            conn.send(kwargs)
            if conn.poll(timeout_s):
                ok, value = conn.recv()
                if ok:
                    return value
                raise ValueError(value)
            reason = f"the chat template did not finish rendering within {timeout_s:g} s"
        except (EOFError, OSError):  # it died (out of memory, killed): start another
            reason = "the chat template exhausted the renderer's memory"
        self._replace()
        raise ValueError(reason)

    def _replace(self):
        proc = self._proc
        proc.kill()
        proc.join(5)
        self._conn.close()
        self._start()

    def close(self):
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def _sandbox_main(conn, tokenizer, max_output_chars: int, media=None):
    """The sandbox process: render what arrives, answer (True, result) or (False, message)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when it stops (and kills it)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # warm up: the first render imports and compiles what every render needs
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] }}")
    except Exception:
        pass
    _limit_heap(SANDBOX_MEMORY_BYTES)
    conn.send("ready")
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = (True, render_chat(tokenizer, max_output_chars=max_output_chars, media=media, **kwargs))
        except MemoryError:
            answer = (False, "the chat template exhausted the renderer's memory")
        except (ValueError, TypeError) as e:
            answer = (False, str(e))
        except Exception as e:  # render_chat wraps the template's errors; anything else is still the request's
            answer = (False, f"the chat template failed: {type(e).__name__}")
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return


def _limit_heap(extra: int):
    """Cap this process's data segment (heap and anonymous mappings) at what it uses now + `extra`."""
    try:
        import resource
        with open(f"/proc/{os.getpid()}/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + extra, resource.RLIM_INFINITY))
    except (ImportError, OSError, StopIteration, ValueError) as e:  # not Linux: the time limit still holds
        logger.warning("the template sandbox runs without a memory limit: %s", e)
