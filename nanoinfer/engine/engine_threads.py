"""The engine's thread rules, mixed into LLMEngine. One thread drives the engine (advance, step,
generate, stream): a second thread that tries while the first is inside one of them gets a
RuntimeError at once (`driving`), since the finishes a step reports go to whoever ran it. A step,
or a change to the request registry, runs under the step lock (`_locked`), which records its holder:
exit() called on that thread (from a signal handler) must not wait for itself."""
import threading
from contextlib import contextmanager


class EngineThreads:
    def _init_threads(self):
        self._step_lock = threading.Lock()
        self._lock_holder: int | None = None
        self._driver: int | None = None  # the thread inside advance / generate / stream
        self._driver_lock = threading.Lock()

    @contextmanager
    def driving(self):
        """Marks the calling thread as the one driving the engine for the block (re-entrant on that
        thread). Another thread already inside is a RuntimeError, raised before anything runs."""
        me = threading.get_ident()
        with self._driver_lock:
            other = self._driver
            if other is not None and other != me:
                raise RuntimeError(
                    "the engine is driven by one thread: another thread is inside generate(), stream(), step() "
                    "or advance(); call them from one thread (add_request and abort_request may be called from any)")
            self._driver = me
        try:
            yield
        finally:
            if other is None:
                self._driver = None

    @contextmanager
    def _locked(self, timeout: float = -1):
        """The step lock, recording its holder; yields whether it was acquired within `timeout` seconds
        (always, with the default: no limit)."""
        if not self._step_lock.acquire(timeout=timeout):
            yield False
            return
        self._lock_holder = threading.get_ident()
        try:
            yield True
        finally:
            self._lock_holder = None
            self._step_lock.release()
