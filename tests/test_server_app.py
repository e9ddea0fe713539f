"""The app's lifespan (nanoinfer/serve/app.py), in process over a stand-in engine client: it starts
and stops the engine, and keeps what start-up made out of the garbage collector's full scans
(gc.freeze) while serving, so that a full collection does not stall every stream."""
import gc

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from nanoinfer.serve.app import build_app  # noqa: E402
from nanoinfer.utils.hf_files import load_tokenizer  # noqa: E402


class StandInEngine:
    """What build_app and the lifespan read of an EngineClient."""

    def __init__(self, path):
        self.tokenizer = load_tokenizer(path)
        self.summary = {}
        self.max_model_len = 4096
        self.started = self.stopped = False

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True


def test_lifespan_starts_the_engine_and_freezes_start_up_objects_while_serving(tiny_qwen3):
    engine = StandInEngine(tiny_qwen3)
    gc.unfreeze()
    app = build_app(engine, "tiny")
    with TestClient(app):
        assert engine.started and not engine.stopped
        assert gc.get_freeze_count() > 0
        assert not any(o is app for o in gc.get_objects())  # (frozen objects are not listed)
    assert engine.stopped and gc.get_freeze_count() == 0


def test_a_sample_that_failed_is_a_500_for_non_finite_logits_else_a_400_with_its_reason():
    from nanoinfer.outputs import NON_FINITE_REASON, CompletionOutput
    from nanoinfer.serve.request_outputs import NON_FINITE_MESSAGE, failure_of

    def sample(finish_reason, stop_reason=None):
        return CompletionOutput(0, "", [], None, None, finish_reason, stop_reason)
    assert failure_of([sample("stop"), sample("length")]) is None
    assert failure_of([sample("stop"), sample("error", NON_FINITE_REASON)]) == (500, NON_FINITE_MESSAGE)
    assert failure_of([sample("error", "structured_outputs.json could not be compiled: x")]) == \
        (400, "structured_outputs.json could not be compiled: x")
