"""The server's engine process: it owns the LLM and runs the engine loop, apart from the HTTP
process, so that building and sending thousands of stream chunks a second never holds up a step.

Messages (pickled over two one-way pipes, every one a batch):
  server -> engine, a list of commands:
      ("add", sub_id, prompts, params, stream)   queue a submission's prompts, all or none
      ("abort", sub_id)                          stop what is left of a submission
      ("stop",)                                  abort everything, exit
  engine -> server, one message per engine step that has news:
      ("ready", info)        once, after the LLM is built: {"model", "max_model_len", "tokenizer"}
      ("failed", kind, text) once, instead of "ready": building the LLM raised kind(text)
      ("step", added, deltas, finals)
          added:  [(sub_id, None | (exception type name, message))], the add_requests error
          deltas: [(sub_id, prompt index, completion index, request id, text, token ids, logprobs,
                    finished, finish reason, stop reason)]  (StreamDelta's fields, as a tuple)
          finals: [(sub_id, prompt index, RequestOutput)]     a request finished or was aborted
      ("dead", text)         the engine loop failed; the process exits

The process ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: the server
decides when to stop) and exits cleanly on SIGTERM, on the commands pipe's EOF, or when the server
process dies (a watcher thread), so it never outlives the server; its LLM's tensor-parallel
workers and shared memory go with it (LLM.exit in a finally).
"""
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection, wait

from nanoinfer.llm import LLM

logger = logging.getLogger("nanoinfer.serve")


def engine_main(model: str, options: dict, commands: Connection, events: Connection, log_level: str):
    """The engine process's entry point (spawned by EngineClient)."""
    global _exiting
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_once)
    _watch_parent()
    try:
        llm = LLM(model, **options)
    except Exception as e:
        events.send(("failed", type(e).__name__, str(e)))
        return
    try:
        events.send(("ready", {"model": llm.config.model, "max_model_len": llm.config.max_model_len,
                               "tokenizer": llm.get_tokenizer()}))
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
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="nanoinfer-parent-watch", daemon=True).start()


class EngineCore:
    """The loop: apply the server's commands, run a step, send what it produced, in one message."""

    def __init__(self, llm, commands: Connection, events: Connection):
        self.llm, self.commands, self.events = llm, commands, events
        self.requests: dict[int, tuple[int, int]] = {}     # request id -> (sub_id, prompt index)
        self.submissions: dict[int, list[int]] = {}        # sub_id -> its request ids
        self.streaming: dict[int, None] = {}               # ordered set of stream=True request ids
        self.added, self.deltas, self.finals = [], [], []  # the next message's parts

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
                self.events.send(("dead", reason))
            except OSError:
                pass
            raise
        self._flush()

    def _apply_commands(self) -> bool:
        """Apply every queued batch of commands (waiting for one while the engine is idle);
        False once told to stop."""
        if not self.llm.is_finished() and not self.commands.poll():
            return True
        while True:
            for command in self.commands.recv():
                kind = command[0]
                if kind == "add":
                    self._add(*command[1:])
                elif kind == "abort":
                    self._abort(command[1])
                else:  # stop
                    for sub_id in list(self.submissions):
                        self._abort(sub_id)
                    return False
            if not self.commands.poll():
                return True

    def _add(self, sub_id: int, prompts: list, params, stream: bool):
        try:  # all or none; as vLLM's server, prompt + max_tokens over max_model_len is an error
            ids = self.llm.add_requests(prompts, [params] * len(prompts), stream=stream, keep_output=True,
                                        max_tokens_must_fit=True)
        except Exception as e:  # ValueError / TypeError naming the field: the client's 400
            self.added.append((sub_id, (type(e).__name__, str(e))))
            return
        for i, rid in enumerate(ids):
            self.requests[rid] = (sub_id, i)
            if stream:
                self.streaming[rid] = None
        self.submissions[sub_id] = ids
        self.added.append((sub_id, None))

    def _abort(self, sub_id: int):
        for rid in self.submissions.get(sub_id, ()):
            if rid in self.requests:  # else it already finished
                self.llm.abort_request(rid)
                self._finish(rid)

    def _step(self):
        finished, _ = self.llm.advance()
        # the step's deltas in one call; d.index is the prompt's position in its submission
        requests = self.requests
        self.deltas += [(requests[d.request_id][0], d.index, d.completion_index, d.request_id, d.text, d.token_ids,
                         d.logprobs, d.finished, d.finish_reason, d.stop_reason)
                        for d in self.llm.take_stream_deltas(self.streaming)]
        for rid in finished:
            if rid in self.requests:
                self._finish(rid)

    def _finish(self, rid: int):
        """Forget a finished (or aborted) request; its final output goes in the next message."""
        sub_id, i = self.requests.pop(rid)
        self.streaming.pop(rid, None)
        self.finals.append((sub_id, i, self.llm.pop_output(rid)))
        rids = self.submissions[sub_id]
        if all(r not in self.requests for r in rids):
            del self.submissions[sub_id]

    def _flush(self):
        if self.added or self.deltas or self.finals:
            self.events.send(("step", self.added, self.deltas, self.finals))
            self.added, self.deltas, self.finals = [], [], []
