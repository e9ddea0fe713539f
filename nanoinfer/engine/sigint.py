"""Ctrl-C deferred to the end of an engine step."""
import signal
import threading
from contextlib import contextmanager


@contextmanager
def sigint_deferred():
    """Ctrl-C during a step is raised when the step ends, so that it never lands between two
    changes of the engine's state (a sequence out of every queue, half its blocks freed). A second
    Ctrl-C raises at once."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught = []

    def handler(*_):
        if caught:  # a second Ctrl-C: the step may be stuck, raise now
            raise KeyboardInterrupt
        caught.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
