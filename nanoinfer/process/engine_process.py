"""The server's engine process: it owns the LLM and runs the engine loop, apart from the HTTP
process, so that building and sending thousands of stream chunks a second never holds up a step.
What the two send each other is in messages.py: a batch of commands in, one StepNews per engine
step that has news out.

The process ignores SIGINT and SIGTERM, and so do its tensor-parallel workers (they inherit it): a
terminal's Ctrl-C, and `timeout`, systemd or Kubernetes stopping the whole process group, reach
every process, and the server decides when the engine stops, after draining its requests. The
engine exits cleanly on the server's Stop, on EXIT_SIGNAL (EngineClient.close), on the commands
pipe's EOF, or when the server process dies (a watcher thread), so it never outlives the server;
its workers and shared memory go with it (LLM.exit in a finally).
"""
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

from nanoinfer.llm import LLM
from nanoinfer.pooling.outputs import PoolingRequestOutput
from nanoinfer.process.messages import (Abort, Admission, EngineDead, EngineStats, Ready, RemoteError, StartFailed,
                                      StepNews, Submit, unpack_command)

logger = logging.getLogger("nanoinfer.serve")

EXIT_SIGNAL = signal.SIGUSR1  # the server's "exit now" (SIGTERM is ignored: see above)
HEALTH_CHECK_S = 1.0  # how often an idle engine checks its tensor-parallel ranks (for /health)
COUNTERS_READ_S = 1.0  # how often the model's device counters (expert-parallel load) are read for /metrics


def engine_main(model: str, options: dict, commands: Connection, events: Connection, log_level: str):
    """The engine process's entry point (spawned by EngineClient)."""
    global _exiting
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (before the workers start: they inherit it)
    signal.signal(EXIT_SIGNAL, _exit_once)
    _watch_parent()
    try:
        llm = LLM(model, **options)
    except Exception as e:
        events.send(StartFailed(RemoteError.of(e)))
        return
    try:
        events.send(Ready(llm.config.model, llm.config.max_model_len, llm.get_tokenizer(), _summary(llm)))
        EngineCore(llm, commands, events).run()
    except (EOFError, BrokenPipeError):
        pass  # the server is gone: nobody to answer
    finally:
        _exiting = True
        llm.exit()


_exiting = False  # set once the process heads for its exit: a SIGTERM then no longer interrupts the cleanup


def _exit_once(*_):
    global _exiting
    if not _exiting:
        _exiting = True
        sys.exit(0)


def _watch_parent():
    """SIGTERM this process when the server process dies (even by SIGKILL)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        wait([parent.sentinel])
        os.kill(os.getpid(), EXIT_SIGNAL)

    threading.Thread(target=watch, name="nanoinfer-parent-watch", daemon=True).start()


class EngineCore:
    """The loop: apply the server's commands, run a step, send what it produced, in one message."""

    def __init__(self, llm, commands: Connection, events: Connection):
        self.llm, self.commands, self.events = llm, commands, events
        self.requests: dict[int, int] = {}                 # request id -> sub_id
        self.submissions: dict[int, dict[int, None]] = {}  # sub_id -> its unfinished request ids (in order)
        self.streaming: dict[int, None] = {}               # ordered set of stream=True request ids
        self.news = StepNews([], [], [])                   # the next message
        # (reading a model's counters waits for the device: at most once every COUNTERS_READ_S)
        self.counters_read = time.monotonic() if llm.model_runner.info()["counters"] else None

    def run(self):
        try:
            while self._apply_commands():
                if not self.llm.is_finished():
                    self._step()
                self._flush()
        except (EOFError, BrokenPipeError):
            raise  # the server is gone
        except BaseException as e:  # failed or terminated: every waiting client gets an error
            if isinstance(e, SystemExit):
                reason = "the engine process was terminated"
            else:
                logger.exception("the engine loop failed")
                reason = f"{type(e).__name__}: {e}"
            try:
                self.events.send(EngineDead(reason))
            except OSError:
                pass
            raise
        self._flush()

    def _apply_commands(self) -> bool:
        """Apply every queued batch of commands (waiting for one while the engine is idle);
        False once told to stop."""
        if not self.llm.is_finished() and not self.commands.poll():
            return True
        while not self.commands.poll(HEALTH_CHECK_S):  # idle: notice a dead rank without a step
            self.llm.check_health()
        while True:
            for packed in self.commands.recv():
                command = self._unpack(packed)
                if command is None:
                    continue
                if isinstance(command, Submit):
                    self._add(command)
                elif isinstance(command, Abort):
                    self._abort(command.sub_id)
                else:  # Stop
                    for sub_id in list(self.submissions):
                        self._abort(sub_id)
                    return False
            if not self.commands.poll():
                return True

    def _unpack(self, packed):
        """The command, or None if it cannot be unpickled: then its submission is refused (any
        other command is the server's own, and its failure a broken pipe)."""
        try:
            return unpack_command(packed)
        except Exception as e:
            sub_id = packed[0]
            if sub_id is None:
                raise
            logger.warning("a submission could not be unpickled: %s: %s", type(e).__name__, e)
            error = ValueError(f"the request could not be read by the engine ({type(e).__name__})")
            self.news.admissions.append(Admission(sub_id, error=RemoteError.of(error)))
            return None

    def _add(self, sub: Submit):
        try:  # all or none; as vLLM's server, prompt + max_tokens over max_model_len is an error
            ids = self.llm.add_requests(sub.prompts, [sub.params] * len(sub.prompts), stream=sub.stream,
                                        keep_output=True, max_tokens_must_fit=sub.max_tokens_must_fit,
                                        priority=sub.priority, lora_requests=[sub.lora_request] * len(sub.prompts))
        except Exception as e:  # ValueError / TypeError naming the field: the client's 400
            self.news.admissions.append(Admission(sub.sub_id, error=RemoteError.of(e)))
            return
        for rid in ids:
            self.requests[rid] = sub.sub_id
            if sub.stream:
                self.streaming[rid] = None
        self.submissions[sub.sub_id] = dict.fromkeys(ids)
        self.news.admissions.append(Admission(sub.sub_id, ids))

    def _abort(self, sub_id: int):
        for rid in list(self.submissions.get(sub_id, ())):
            self.llm.abort_request(rid)
            self._finish(rid)

    def _step(self):
        finished, _ = self.llm.advance()
        # the step's deltas in one call; d.index is the prompt's position in its submission
        self.news.deltas += self.llm.take_stream_deltas(self.streaming)
        for rid in finished:
            if rid in self.requests:
                self._finish(rid)

    def _finish(self, rid: int):
        """Forget a finished (or aborted) request; its final output goes in the next message."""
        sub_id = self.requests.pop(rid)
        self.streaming.pop(rid, None)
        out = self.llm.pop_output(rid)
        if isinstance(out, PoolingRequestOutput):  # a numpy array pickles as bytes; a torch tensor
            out.outputs.data = out.outputs.data.numpy()  # would cross as shared memory, an fd each
        self.news.finals.append(out)
        unfinished = self.submissions[sub_id]
        del unfinished[rid]
        if not unfinished:
            del self.submissions[sub_id]

    def _flush(self):
        news = self.news
        if news.admissions or news.deltas or news.finals:
            scheduler = self.llm.scheduler
            blocks = scheduler.block_manager
            waiting = len(scheduler.waiting) + len(scheduler.held_under) + len(scheduler.preparing)
            news.stats = EngineStats(len(scheduler.running), waiting, blocks.num_blocks - blocks.num_free_blocks, blocks.num_blocks,
                                     scheduler.num_preemptions)
            spec = self.llm.spec_stats
            if spec is not None:
                news.stats.spec = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
            if self.counters_read is not None and time.monotonic() - self.counters_read >= COUNTERS_READ_S:
                self.counters_read = time.monotonic()
                news.stats.counters = self.llm.model_runner.info()["counters"]
            self.events.send(news)
            self.news = StepNews([], [], [])


def _summary(llm) -> dict:
    config = llm.config
    blocks = llm.scheduler.block_manager.num_blocks
    return dict(dtype=str(config.torch_dtype).removeprefix("torch."), kv_blocks=blocks, runner=config.runner,
                vocab_size=min(llm.vocab_size, len(llm.tokenizer)),
                block_size=config.kvcache_block_size, kv_tokens=blocks * config.kvcache_block_size,
                max_num_seqs=config.max_num_seqs, tensor_parallel_size=config.tensor_parallel_size,
                max_concurrency=round(blocks * config.kvcache_block_size / config.max_model_len, 2))
