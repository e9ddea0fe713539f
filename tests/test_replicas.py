"""Data-parallel serving (serve/replicas.py): `nanoinfer serve --data-parallel-size 2` on the tiny
model, a real server process driven by the openai client, checked against the offline API."""
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_server import (NAME, OPTIONS, PROMPTS, Server, descendants, offline, running, shm_entries,
                         wait_until)

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("dp") / "server.log", data_parallel_size=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from nanoinfer import LLM
    engine = LLM(tiny_qwen3, **OPTIONS)
    yield engine
    engine.exit()


def engine_pids(server_pid: int) -> list[int]:
    """The replicas' engine processes: the server's children started by multiprocessing's spawn."""
    found = []
    for pid in descendants(server_pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except OSError:
            continue
        if parent == server_pid and spawned and running(pid):
            found.append(pid)
    return found


def replicas(server) -> list[dict]:
    return server.stats()["replicas"]


def prefix_hits(server) -> dict[str, float]:
    """nanoinfer:prefix_cache_hits_total by replica (the `engine` label)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "nanoinfer:prefix_cache_hits_total"}


def test_concurrent_greedy_requests_match_offline_on_both_replicas(llm, server, client):
    """16 clients at once, half streaming: each gets its offline greedy text, and both replicas
    serve; /stats and /metrics count per replica."""
    jobs = [(PROMPTS[i % 4] + " " * (i // 4), 4 + i % 5, i % 2 == 1) for i in range(16)]

    def run(job):
        prompt, max_tokens, stream = job
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(
                model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True))
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0).choices[0].text

    before = replicas(server)
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    assert got == [offline(llm, p, max_tokens=m, temperature=0)["text"] for p, m, _ in jobs]
    after = server.stats()
    served = [a["requests_finished"] - b["requests_finished"] for a, b in zip(after["replicas"], before)]
    assert sum(served) == len(jobs) and min(served) > 0, served
    assert after["requests_running"] == 0 and all(r["alive"] for r in after["replicas"])
    assert after["requests_finished"] == sum(r["requests_finished"] for r in after["replicas"])
    assert set(prefix_hits(server)) == {"0", "1"}
    # n > 1 and chat go to one replica each, as with one engine
    params = dict(n=3, temperature=1.0, seed=7, max_tokens=10)
    out = client.completions.create(model=NAME, prompt=PROMPTS[3], **params)
    assert [c.text for c in out.choices] == [c.text for c in offline(llm, PROMPTS[3], **params).outputs]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = llm.chat(messages, offline_params(max_tokens=8), use_tqdm=False)[0]["text"]
    assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                          temperature=0).choices[0].message.content == want


def offline_params(**params):
    from nanoinfer import SamplingParams
    return SamplingParams(temperature=0, **params)


def test_the_same_prefix_lands_on_the_replica_that_cached_it(llm, server, client):
    """Two requests sharing a 5-block prefix, one after the other: the second goes where the first
    went (on an idle server, ties are otherwise taken in turn) and its prefix is a cache hit there."""
    block = OPTIONS["kvcache_block_size"]
    shared = [(7 * i) % 300 + 10 for i in range(5 * block)]
    before, hits_before = replicas(server), prefix_hits(server)
    for suffix in ([11, 12, 13], [21, 22, 23, 24]):
        out = client.completions.create(model=NAME, prompt=shared + suffix, max_tokens=4, temperature=0)
        assert out.choices[0].text == offline(llm, shared + suffix, max_tokens=4, temperature=0)["text"]
    served = [a["requests_finished"] - b["requests_finished"] for a, b in zip(replicas(server), before)]
    assert sorted(served) == [0, 2], served
    home = str(served.index(2))
    hits = prefix_hits(server)
    assert hits[home] - hits_before[home] >= 5 * block, (hits, hits_before)


def test_a_killed_replica_fails_only_its_requests_and_comes_back(llm, server, client):
    """Two streams, one on each replica; one replica's engine process is killed: its stream ends
    with an OpenAI-shaped 503 error event, the other goes on, new requests are served meanwhile,
    and the replica is restarted (logged) and serves again."""
    wait_until(lambda: all(r["alive"] for r in replicas(server)), what="both replicas to serve")
    pids = engine_pids(server.proc.pid)
    assert len(pids) == 2
    restarts = sum(r["restarts"] for r in replicas(server))
    responses = [client.completions.create(model=NAME, prompt=p, max_tokens=3000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}) for p in PROMPTS[:2]]
    streams = [iter(r) for r in responses]
    texts = [next(s).choices[0].text for s in streams]  # both in flight
    assert [r["requests_running"] for r in replicas(server)] == [1, 1]
    # each stream read by its own thread: the killed replica's may first deliver what it had made
    errors: list = [None, None]
    counts = [0, 0]

    def consume(i):
        try:
            for chunk in streams[i]:
                texts[i] += chunk.choices[0].text
                counts[i] += 1
        except openai.APIError as e:
            errors[i] = e
        except Exception as e:  # (the survivor's response closed below, while it is read)
            errors[i] = errors[i] or e

    readers = [threading.Thread(target=consume, args=(i,), daemon=True) for i in (0, 1)]
    for t in readers:
        t.start()
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: any(isinstance(e, openai.APIError) for e in errors), what="the killed replica's stream to fail")
    failed = [i for i, e in enumerate(errors) if isinstance(e, openai.APIError)]
    assert len(failed) == 1, errors
    assert errors[failed[0]].body["code"] == 503 and \
        errors[failed[0]].body["type"] == "ServiceUnavailableError", errors[failed[0]].body
    survivor = 1 - failed[0]
    seen = counts[survivor]
    wait_until(lambda: counts[survivor] >= seen + 20 or errors[survivor] is not None, what="the survivor to go on")
    assert errors[survivor] is None, errors[survivor]
    responses[survivor].close()  # the client leaves: its request is aborted on its replica
    for t in readers:
        t.join(30)
    assert len(texts[survivor]) > 0 and offline(llm, PROMPTS[survivor], max_tokens=3000, temperature=0,
                                                ignore_eos=True)["text"].startswith(texts[survivor])
    wait_until(lambda: server.stats()["requests_running"] == 0, what="the abandoned stream to be aborted")
    # meanwhile the server answers, on the replica left
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    wait_until(lambda: sum(r["restarts"] for r in replicas(server)) == restarts + 1 and
               all(r["alive"] for r in replicas(server)), what="the replica to restart")
    assert "restarted" in server.log()
    new_pids = engine_pids(server.proc.pid)
    assert len(new_pids) == 2 and pids[1] in new_pids and pids[0] not in new_pids
    before = replicas(server)
    for i in range(4):  # distinct prompts on an idle server: both replicas serve again
        client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=2, temperature=0)
    assert all(a["requests_finished"] > b["requests_finished"] for a, b in zip(replicas(server), before))


def test_shutdown_ends_every_replica_and_leaves_nothing(llm, tiny_qwen3, tmp_path):
    """SIGTERM with a request in flight and a replica being restarted: the request still ends, then
    the server and every replica's engine process (tensor-parallel workers included, the one still
    starting too) exit, leaving no shared memory."""
    srv = Server(tiny_qwen3, tmp_path / "server.log", data_parallel_size=2, tensor_parallel_size=2)
    try:
        children = set(descendants(srv.proc.pid))
        first = engine_pids(srv.proc.pid)
        assert len(first) == 2 and len(children) >= 2 + 2 * 2
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: len(set(engine_pids(srv.proc.pid)) - set(first)) == 1, what="the restart to begin")
        stream = iter(srv.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}))
        chunks = [next(stream)]  # on the replica left
        children |= set(descendants(srv.proc.pid))
        srv.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert "".join(c.choices[0].text for c in chunks) == \
            offline(llm, PROMPTS[0], max_tokens=20, temperature=0, ignore_eos=True)["text"]
        assert srv.proc.wait(timeout=120) == 0, srv.log()
    finally:
        srv.stop()
    wait_until(lambda: not [p for p in children if running(p)], timeout=60, what="the server's children to exit")
    assert not shm_entries([srv.proc.pid, *children])


def test_data_parallel_flags(tiny_qwen3):
    from nanoinfer.serve.cli import build_parser, main
    args = build_parser().parse_args(["serve", "m", "-dp", "3", "--data-parallel-backend", "ray"])
    assert (args.data_parallel_size, args.data_parallel_backend) == (3, "ray")
    assert build_parser().parse_args(["serve", "m"]).data_parallel_size == 1
    assert main(["serve", tiny_qwen3, "--port", "0", "--data-parallel-size", "0"]) == 2  # before any engine starts
