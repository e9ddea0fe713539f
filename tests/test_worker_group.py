"""WorkerGroup (engine/worker_group.py) with plain targets: a worker that dies after answering
fails the wait at once, naming it; workers that answer "exit" and leave are no failure; a
worker silent past the timeout is named; payloads reach the workers, through a grown segment,
and no segment name outlives the first answers."""
import os
import time

import pytest

from nanoinfer.engine.worker_group import WorkerFailure, WorkerGroup


def echo_then(channel, rank_to_die: int, delay: float):
    """Answer start-up; then per call: echo the payload's length, except that rank `rank_to_die`
    answers and then exits with code 3 while the others take `delay` seconds to answer. "exit"
    ends the loop."""
    channel.answer("up")
    while True:
        message = channel.recv()
        if message[0] == "exit":
            channel.answer()
            return
        data = bytes(channel.payload(message[1]))
        if channel.rank == rank_to_die:
            channel.answer(len(data))
            os._exit(3)
        time.sleep(delay)
        channel.answer(len(data))


def our_segments():
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"nanoinfer-test_{os.getpid()}_")]


def test_payloads_growth_and_a_polite_exit():
    group = WorkerGroup(2, echo_then, lambda rank: (-1, 0.0), "nanoinfer-test")
    try:
        assert group.wait("start-up", timeout=120) == ["up", "up"]
        assert our_segments() == []  # mapped by every worker: unlinked
        for size in (10, 3 << 20):  # the second outgrows the 1 MiB segment
            group.call([("echo", (0, size))] * 2, b"x" * size)
            assert group.wait("a call", timeout=60) == [size, size]
        assert our_segments() == []
        group.call([("exit",)] * 2)
        group.wait("exit", timeout=60, exiting=True)  # they may be gone before the last answer is read
    finally:
        group.stop(10.0)
    assert all(p.exitcode == 0 for p in group.procs) and our_segments() == []


def test_a_worker_that_dies_after_answering_fails_the_wait_at_once():
    """On CUDA a rank answers once its step is queued; if it then dies, its peers wait for it on the
    device and never answer: the wait must not sit out the timeout."""
    group = WorkerGroup(2, echo_then, lambda rank: (1, 30.0), "nanoinfer-test")
    try:
        group.wait("start-up", timeout=120)
        group.call([("echo", (0, 4))] * 2, b"abcd")
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"rank 1: process \d+ exited with code 3"):
            group.wait("a step", timeout=60)
        assert time.monotonic() - start < 5
    finally:
        group.stop(0.0)
    assert not any(p.is_alive() for p in group.procs) and our_segments() == []


def test_a_silent_worker_is_named_at_the_timeout():
    group = WorkerGroup(2, echo_then, lambda rank: (-1, 30.0 if rank == 1 else 0.0), "nanoinfer-test")
    try:
        group.wait("start-up", timeout=120)
        group.call([("echo", (0, 1))] * 2, b"z")
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"rank 1: process \d+ did not answer a step within 2 s \(slow"):
            group.wait("a step", timeout=2)
        assert 2 <= time.monotonic() - start < 5
    finally:
        group.stop(0.0)
    assert not any(p.is_alive() for p in group.procs)
