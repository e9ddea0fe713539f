"""The pipe between the HTTP process and the engine process (process/engine_client.py,
engine_process.py): a command that cannot cross fails only its own submission, and any other failure
of the writer, the reader or the engine loop leaves a dead engine that says so (never a live-looking
one that answers nobody), with its process ended and reaped."""
import asyncio
import pickle
import threading

import pytest

from nanoinfer.sampling_params import SamplingParams
from nanoinfer.process.engine_client import EngineClient, EngineDeadError
from test_server import OPTIONS, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


class LoopThread:
    """An event loop in a thread, as the server's: the client's coroutines run on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def started_client(model) -> tuple[EngineClient, LoopThread]:
    loop = LoopThread()
    client = EngineClient(model, OPTIONS)

    async def start():
        client.start()
    loop.run(start())
    return client, loop


async def generate(client: EngineClient, prompt) -> list[int]:
    sub = await client.submit([prompt], GREEDY, stream=False)
    async for _, event in sub.results():
        pass
    return event.outputs[0].token_ids


def nested(depth: int):
    x = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    client, loop = started_client(tiny_qwen3)
    yield client, loop
    client.stop()
    loop.close()


def test_a_submission_that_cannot_be_pickled_fails_alone(engine):
    client, loop = engine
    before = loop.run(generate(client, "Hello, my name is"))
    deep = SamplingParams(temperature=0.0, max_tokens=4)
    deep.extra_args = {"x-junk": nested(5000)}  # passes every check, but pickling recurses too deep
    with pytest.raises(ValueError, match="nested too deeply"):
        loop.run(client.submit(["hi"], deep, stream=False))
    assert client.alive and client.outstanding_tokens == 0
    assert loop.run(generate(client, "Hello, my name is")) == before


def test_a_submission_the_engine_cannot_unpickle_fails_alone(engine, monkeypatch):
    client, loop = engine
    before = loop.run(generate(client, "The quick brown fox"))
    monkeypatch.setattr("nanoinfer.process.engine_client.pack_command",
                        lambda command: (command.sub_id, b"not a pickle"))
    with pytest.raises(ValueError, match="could not be read by the engine"):
        loop.run(client.submit(["hi"], GREEDY, stream=False))
    monkeypatch.undo()
    assert client.alive
    assert loop.run(generate(client, "The quick brown fox")) == before


def break_writer(client, monkeypatch):
    def send(_):
        raise RuntimeError("the writer broke")
    monkeypatch.setattr(client._commands, "send", send)


def break_dispatch(client, monkeypatch):
    def dispatch(_):
        raise KeyError("a message nobody expected")
    monkeypatch.setattr(client, "_dispatch", dispatch)


def break_engine_loop(client, monkeypatch):
    real = client._commands.send

    def send(batch):  # a command of the server's own that the engine cannot read: its loop fails
        real([(None, b"not a pickle")] + batch)
    monkeypatch.setattr(client._commands, "send", send)


@pytest.mark.parametrize("breaks", [break_writer, break_dispatch, break_engine_loop],
                         ids=["writer", "reader", "engine loop"])
def test_a_broken_pipe_or_loop_leaves_a_dead_engine_ended_and_reaped(tiny_qwen3, monkeypatch, breaks):
    client, loop = started_client(tiny_qwen3)
    try:
        breaks(client, monkeypatch)
        with pytest.raises(EngineDeadError):  # the waiting client is told, never left hanging
            loop.run(generate(client, "Hello"), timeout=60)
        assert not client.alive  # /health says 503; a data-parallel replica is restarted
        with pytest.raises(EngineDeadError):
            loop.run(client.submit(["Hello"], GREEDY, stream=False))
        # its process is ended and waited for, without close(): no zombie, no orphan
        wait_until(lambda: client.process.exitcode is not None, timeout=60, what="the engine process reaped")
    finally:
        client.close()
        loop.close()


def test_commands_cross_the_pipe_one_pickle_each():
    from nanoinfer.process.messages import Abort, Submit, pack_command, unpack_command
    submit = Submit(7, ["hi"], GREEDY, stream=False)
    assert pack_command(submit)[0] == 7 and pack_command(Abort(7))[0] is None
    assert unpack_command(pack_command(submit)).prompts == ["hi"]
    assert pickle.loads(pack_command(Abort(3))[1]).sub_id == 3
