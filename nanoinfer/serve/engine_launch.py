"""Starting and ending the engine process (engine_process.py) that an EngineClient talks to."""
import multiprocessing as mp
import os
import threading
from contextlib import contextmanager

from nanoinfer.process.engine_process import EXIT_SIGNAL, engine_main

STOP_TIMEOUT_S = 5.0   # a stopping engine aborts its requests and stops its workers; then SIGTERM, SIGKILL


def launch_engine_process(model: str, options: dict, log_level: str, env: dict):
    """Start an engine process (engine_process.py); returns it and the ends of its two pipes that
    this process keeps: commands (send) and events (recv)."""
    ctx = mp.get_context("spawn")
    commands_reader, commands = ctx.Pipe(duplex=False)
    events, events_writer = ctx.Pipe(duplex=False)
    # Not daemonic: a daemonic process cannot start the tensor-parallel workers. It exits by
    # itself when this process dies (engine_process.py); stop() / close() end it otherwise.
    process = ctx.Process(target=engine_main, name="nanoinfer-engine",
                          args=(model, options, commands_reader, events_writer, log_level))
    with _environ(env):
        process.start()
    commands_reader.close()  # our copies: the engine's end closing is then an EOF here
    events_writer.close()
    return process, commands, events


def end_engine_process(process, timeout: float = STOP_TIMEOUT_S):
    """End an engine process if it still runs (EXIT_SIGNAL: it cleans up; then SIGKILL)."""
    if process.is_alive():
        try:
            os.kill(process.pid, EXIT_SIGNAL)  # it ignores SIGTERM; this one makes it clean up and exit
        except ProcessLookupError:  # it ended since is_alive()
            pass
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()


_environ_lock = threading.Lock()


@contextmanager
def _environ(env: dict):
    """os.environ with `env` on top, while a process starts (a spawned process copies it)."""
    if not env:
        yield
        return
    with _environ_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
