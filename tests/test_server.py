"""The OpenAI-compatible server: a real `python -m nanoinfer serve` process on a free localhost port,
driven by the official openai client (and httpx for raw HTTP), checked against the offline API."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from memory_pipe import MemoryPipe, drive_until_done

openai = pytest.importorskip("openai")

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.config import Config  # noqa: E402
from nanoinfer.serve.cli import build_parser  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny"
# 4096-token contexts: a request that cannot end during a test (the disconnect test) fits
OPTIONS = dict(max_model_len=4096, kvcache_block_size=16, num_kvcache_blocks=512, max_num_seqs=32)
STARTUP_TIMEOUT = 600  # seconds; a loaded 2-core machine imports torch and builds the engine slowly
PROMPTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache stores", "Once upon a time"]


class Server:
    """`python -m nanoinfer serve MODEL` on a free port, its output in a log file."""

    def __init__(self, model: str, log_path, new_session: bool = False, extra_args: tuple = (), **options):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        flags = [x for k, v in {**OPTIONS, **options}.items()
                 for x in ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v)))]
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nanoinfer", "serve", model, "--port", str(self.port),
                 "--served-model-name", NAME, "--log-level", "warning", *flags, *extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=new_session)
        self.wait_healthy()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]

    def wait_healthy(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            try:
                self.proc.wait(timeout=0.2)  # poll interval: returns early if the server dies
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        pytest.fail(f"the server did not become healthy in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def descendants(pid: int) -> list[int]:
    """The pids of a process's children, their children, ... (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it exited meanwhile
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def engine_pid(server_pid: int) -> int:
    """The server's engine process: its one child started by multiprocessing's spawn (the other
    may be multiprocessing's resource tracker)."""
    (pid,) = [p for p in descendants(server_pid) if _parent(p) == server_pid and "spawn_main" in _cmdline(p)]
    return pid


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")


def shm_entries(pids) -> list[str]:
    """/dev/shm entries named after one of these processes (tp segments: unlinked once mapped)."""
    return [f for f in os.listdir("/dev/shm") if any(f.startswith(f"nanoinfer-tp_{p}_") for p in pids)]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, **OPTIONS)
    yield engine
    engine.exit()


@pytest.fixture
def serving(server, client):
    """After the test, the server still answers a request."""
    yield
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert len(out.choices) == 1 and out.usage.completion_tokens == 2, server.log()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


# ---- endpoints and parity with the offline API ----------------------------------------------------
def test_health_models_and_stats(server, client):
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == OPTIONS["max_model_len"]
    stats = server.stats()
    assert set(stats) == {"requests_running", "requests_finished", "prompt_tokens_total", "generation_tokens_total"}


def test_cli_has_a_flag_for_every_engine_option():
    args = build_parser().parse_args(["serve", "m", "--max-model-len", "512", "--no-async-scheduling",
                                      "--num-kvcache-blocks", "none", "--gpu-memory-utilization", "0.5"])
    assert (args.max_model_len, args.async_scheduling, args.num_kvcache_blocks) == (512, False, None)
    assert args.gpu_memory_utilization == 0.5 and not hasattr(args, "dtype")  # unset: Config's default
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name in Config.option_names():
        assert f"--{name.replace('_', '-')}" in help_text


def test_completion_greedy_matches_offline(llm, client, serving):
    out = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == NAME
    want = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [w["text"] for w in want]
    assert [c.finish_reason for c in out.choices] == [w["finish_reason"] for w in want]
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    completion_tokens = sum(len(w["token_ids"]) for w in want)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def test_completion_token_id_prompts(llm, client, serving):
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    want = offline(llm, ids, max_tokens=8, temperature=0)["text"]
    assert client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0).choices[0].text == want
    out = client.completions.create(model=NAME, prompt=[ids, ids[:3]], max_tokens=8, temperature=0)
    assert out.choices[0].text == want and out.usage.prompt_tokens == len(ids) + 3


def test_completion_stream_matches_offline(llm, client, serving):
    want = offline(llm, PROMPTS[0], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks, last = chunks[:-1], chunks[-1]
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == want["text"]
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == want["finish_reason"]
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert last.choices == [] and last.usage.completion_tokens == len(want["token_ids"])
    assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(c.usage is None for c in text_chunks)


# A prompt of one byte token (an orphan UTF-8 continuation byte) repeated: the tiny model answers with
# byte tokens that never complete a character, so the detokenizer releases their text only at the end
BYTE_PROMPT = [112] * 20


@pytest.mark.parametrize("prompt", [PROMPTS[0], BYTE_PROMPT], ids=["text", "bytes"])
def test_stream_sends_a_chunk_per_step(llm, server, serving, prompt):
    """One chunk per engine step (one token each here), text or not, arriving while the completion is
    generated, not all at its end; a chunk whose text is held back has text "" (as vLLM sends it)."""
    max_tokens = 40
    want = offline(llm, prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    body = dict(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
    chunks, arrivals = [], []
    start = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
                arrivals.append(time.perf_counter())
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # one per step unless the server's event loop fell behind the engine (then merged); before, the
    # byte prompt's 40 tokens came in 1 chunk
    assert len(chunks) >= max_tokens // 4, [c["choices"][0]["text"] for c in chunks]
    assert len(chunks) <= max_tokens
    # spread over the generation: before, the chunks of held-back text arrived together at the end
    assert arrivals[-1] - arrivals[0] >= 0.25 * (arrivals[-1] - start), (start, arrivals)


def test_chat_matches_offline(llm, client, serving):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    want = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want["text"]
    assert out.choices[0].finish_reason == want["finish_reason"]
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == len(want["token_ids"])
    # max_completion_tokens is OpenAI's newer name; content parts are joined like render_chat does
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]
    again = client.chat.completions.create(model=NAME, messages=parts, max_completion_tokens=12, temperature=0)
    assert again.choices[0].message.content == want["text"]

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want["text"]
    assert chunks[-2].choices[0].finish_reason == want["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_n_and_seed_match_offline(llm, client, serving):
    params = dict(n=3, temperature=1.0, seed=7, max_tokens=10)
    want = offline(llm, PROMPTS[3], **params)
    out = client.completions.create(model=NAME, prompt=PROMPTS[3], **params)
    assert [c.text for c in out.choices] == [c.text for c in want.outputs]
    assert len({c.text for c in out.choices}) > 1  # seed + i per sample: they differ
    two = client.completions.create(model=NAME, prompt=PROMPTS[:2], **params)
    assert [c.index for c in two.choices] == list(range(6))  # prompt i's sample j is choice i * n + j
    assert [c.text for c in two.choices[:3]] == [c.text for c in offline(llm, PROMPTS[0], **params).outputs]
    streamed = {}
    for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                stream=True, **params):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    want_chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(**params), use_tqdm=False)[0]
    assert streamed == {c.index: c.text for c in want_chat.outputs}


@pytest.mark.parametrize("params", [
    dict(temperature=0, stop_token_ids=[10, 11, 12, 13, 14, 15]),
    dict(temperature=0, ignore_eos=True, min_tokens=5, max_tokens=20),
    dict(temperature=0.9, top_k=5, min_p=0.05, top_p=0.9, seed=3, repetition_penalty=1.3),
    dict(temperature=0.7, presence_penalty=1.5, frequency_penalty=-0.5, seed=11, max_tokens=24),
])
def test_sampling_options_match_offline(llm, client, serving, params):
    params = {"max_tokens": 16, **params}
    want = offline(llm, PROMPTS[2], **params).outputs[0]
    standard = {k: v for k, v in params.items() if k in ("temperature", "top_p", "seed", "max_tokens",
                                                          "presence_penalty", "frequency_penalty")}
    extra = {k: v for k, v in params.items() if k not in standard}
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], extra_body=extra, **standard).choices[0]
    assert (out.text, out.finish_reason, out.model_extra["stop_reason"]) == \
        (want.text, want.finish_reason, want.stop_reason)


def test_stop_strings_match_offline(llm, client, serving):
    text = offline(llm, PROMPTS[0], max_tokens=16, temperature=0)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = offline(llm, PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == want["text"] and want["text"] != text
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == want["text"]


def test_logprobs(llm, client, serving):
    want = offline(llm, PROMPTS[1], max_tokens=6, temperature=0, logprobs=3).outputs[0]
    out = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert all(1 <= len(top) <= 4 and max(top.values()) == pytest.approx(lp_, abs=1e-5)  # greedy: the top one
               for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    stream_lps = [x for c in client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                                        logprobs=3, stream=True) if c.choices[0].logprobs
                  for x in c.choices[0].logprobs.token_logprobs]
    assert stream_lps == pytest.approx(lp.token_logprobs, abs=1e-4)

    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_concurrent_clients_match_offline(llm, server, client, serving):
    """24 clients at once, half streaming: each gets exactly its offline greedy result."""
    jobs = [(PROMPTS[i % 4] + " " * (i // 4), 4 + i % 5, i % 2 == 1) for i in range(24)]

    def run(job):
        prompt, max_tokens, stream = job
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(
                model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True))
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return out.choices[0].text

    before = server.stats()["requests_finished"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    want = [offline(llm, prompt, max_tokens=max_tokens, temperature=0)["text"] for prompt, max_tokens, _ in jobs]
    assert got == want
    stats = server.stats()
    assert stats["requests_finished"] - before == len(jobs) and stats["requests_running"] == 0


def test_serving_benchmark(server, serving, capsys):
    from nanoinfer.serve import bench

    # (no --vocab-size: the tiny model's 384 tokens come from the server's /v1/models)
    assert bench.served_vocab_size(server.url) == 384
    assert bench.main(["--url", server.url, "--num-requests", "6", "--input-len", "5", "20", "--output-len", "3", "8",
                       "--request-rate", "50", "--max-concurrency", "4"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"Successful requests: +6\n", printed) and re.search(r"P99 ITL \(ms\): +[0-9.]+\n", printed)
    # nothing succeeds (no server there): it says so and exits non-zero, with no table of nan
    assert bench.main(["--url", "http://127.0.0.1:1", "--num-requests", "2", "--vocab-size", "300",
                       "--client-processes", "1"]) == 1
    out, err = capsys.readouterr()
    assert "no request succeeded" in err and "nan" not in out + err
    workload = bench.make_workload(6, "random", (5, 20), (3, 8), 300, 0)
    results, duration = asyncio.run(bench.run_benchmark(server.url, workload, NAME, max_concurrency=3))
    assert [r.error for r in results] == [None] * 6
    assert [r.output_tokens for r in results] == workload.output_lens  # ignore_eos: every token asked for
    assert all(0 < r.ttft <= r.latency <= duration and len(r.itl) == r.chunks - 1 and 0 < r.chunks <= r.output_tokens
               for r in results)
    summary = bench.summarize(results, duration)
    assert summary["total_output_tokens"] == sum(workload.output_lens) and summary["p50_ttft_ms"] > 0
    assert summary["tokens_per_chunk"] >= 1
    # two client processes: every request, in workload order, and each process's CPU time
    results, duration, cpu = bench.run_parallel(server.url, workload, NAME, request_rate=100, processes=2)
    assert [r.error for r in results] == [None] * 6 and len(cpu) == 2 and all(c > 0 for c in cpu)
    assert [(r.prompt_tokens, r.output_tokens) for r in results] == \
        [(len(p), n) for p, n in zip(workload.prompts, workload.output_lens)]
    assert "client_cpu_percent" in bench.summarize(results, duration, cpu)
    sharegpt = bench.make_workload(200, "sharegpt")
    assert 4 <= min(map(len, sharegpt.prompts)) < np.median(list(map(len, sharegpt.prompts))) < 300


# ---- client disconnects -------------------------------------------------------------------------
def wait_until(condition, timeout: float = 300, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)  # poll interval


def test_disconnect_mid_stream_aborts_only_that_request(llm, server, client, serving):
    long = 4000  # far more tokens than the request can make before the abort
    before = server.stats()
    other = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True)
    gone = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=long, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), gone):
        pass
    gone.close()  # the client goes away mid-stream
    text = "".join(c.choices[0].text for c in other)  # the other request goes on to its end
    assert text == offline(llm, PROMPTS[0], max_tokens=24, temperature=0)["text"]
    wait_until(lambda: server.stats()["requests_running"] == 0, what="the aborted request to leave the engine")
    after = server.stats()
    assert after["requests_finished"] - before["requests_finished"] == 2
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 24 + long, "the disconnected request ran to its end"


def test_disconnect_while_waiting_for_a_full_response(server, serving):
    before = server.stats()
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up on a long non-streaming request
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1))
    wait_until(lambda: server.stats()["requests_finished"] > before["requests_finished"],
               what="the abandoned request to leave the engine")
    generated = server.stats()["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 4000, "the abandoned request ran to its end"


# ---- errors -------------------------------------------------------------------------------------
LONG_PROMPT = list(range(10, 110)) * 41  # 4100 token ids > max_model_len
ERRORS = [
    ("completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "Hi", "top_p": 2}, 400, "top_p"),
    ("completions", {"prompt": "Hi", "n": "many"}, 400, "n"),
    ("completions", {"prompt": "Hi", "n": True}, 400, "n"),
    ("completions", {"prompt": "Hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("completions", {"prompt": "Hi", "max_tokens": 5000}, 400, None),
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, None),
    ("completions", {"prompt": [1, 2, 10**6]}, 400, None),
    ("completions", {"prompt": ""}, 400, None),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    ("completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenize": True}},
     400, "messages"),
    # (refused without --trust-request-chat-template; test_server_limits.py renders such templates)
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{% if %}"},
     400, "chat_template"),
    ("completions", {"prompt": "Hi", "n": 129}, 400, "n"),
    ("completions", {"prompt": "Hi", "stop": ["x"] * 65}, 400, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("endpoint, body, status, param", ERRORS)
def test_errors_are_openai_shaped(server, serving, endpoint, body, status, param):
    body = {"model": NAME, "max_tokens": 4, **body}
    for stream in (False, True) if "stream_options" not in body else (False,):
        r = httpx.post(f"{server.url}/v1/{endpoint}", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
        assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")
        if param is not None:
            assert error["param"] == param


def test_length_error_names_the_lengths(server, serving):
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": LONG_PROMPT, "max_tokens": 1})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and str(len(LONG_PROMPT)) in message and str(OPTIONS["max_model_len"]) in message


def test_malformed_json_and_unknown_routes(server, client, serving):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Hi",', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="Hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])


# ---- shutdown ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, sig", [(1, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGTERM)])
def test_shutdown_ends_in_flight_requests_and_leaves_nothing(llm, tiny_qwen3, tmp_path, tp, sig):
    """SIGTERM / SIGINT (Ctrl-C): the in-flight request still ends, then the server and its engine
    process (tp workers included) exit, leaving no shared memory."""
    srv = Server(tiny_qwen3, tmp_path / "server.log", tensor_parallel_size=tp)
    try:
        children = descendants(srv.proc.pid)
        assert engine_pid(srv.proc.pid) in children
        assert len(children) >= 1 + tp and not shm_entries(children)  # the engine + tp workers (tp > 1)
        stream = iter(srv.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}))
        chunks = [next(stream)]  # the request is in flight
        srv.proc.send_signal(sig)
        chunks += list(stream)  # it still ends normally
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in chunks) == \
            offline(llm, PROMPTS[0], max_tokens=20, temperature=0, ignore_eos=True)["text"]
        assert srv.proc.wait(timeout=120) == 0, srv.log()
    finally:
        srv.stop()
    # multiprocessing's resource tracker, if any, leaves once the last process holding its pipe has
    wait_until(lambda: not [p for p in children if running(p)], timeout=60, what="the server's children to exit")
    assert not shm_entries([srv.proc.pid, *children])
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=10)


def test_killed_server_takes_its_engine_along(tiny_qwen3, tmp_path):
    """SIGKILL of the server process: the engine process and its tp workers exit by themselves,
    freeing their shared memory."""
    srv = Server(tiny_qwen3, tmp_path / "server.log", tensor_parallel_size=2)
    children = descendants(srv.proc.pid)
    assert engine_pid(srv.proc.pid) in children and len(children) >= 3  # the engine and its 2 tp workers
    srv.proc.kill()
    srv.proc.wait(timeout=60)
    wait_until(lambda: not [p for p in children if running(p)], timeout=120, what="the engine processes to exit")
    assert not shm_entries(children)


def test_dead_engine_is_reported(tiny_qwen3, tmp_path):
    """The engine process dies: /health and new requests answer 503, and the server still shuts
    down cleanly."""
    srv = Server(tiny_qwen3, tmp_path / "server.log")
    try:
        os.kill(engine_pid(srv.proc.pid), signal.SIGKILL)
        wait_until(lambda: httpx.get(srv.url + "/health", timeout=30).status_code == 503, what="/health to fail")
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", r.text
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=120) == 0, srv.log()
    finally:
        srv.stop()


def test_bad_engine_option_exits_with_the_error(tiny_qwen3, tmp_path):
    """An option the engine refuses (checked in the engine process) ends `serve` with status 2 and
    the engine's message."""
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        code = subprocess.run([sys.executable, "-m", "nanoinfer", "serve", tiny_qwen3, "--max-num-seqs", "0"],
                              stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=STARTUP_TIMEOUT).returncode
    text = log.read_text()
    assert code == 2 and "max_num_seqs must be" in text, text


def test_engine_core_takes_each_steps_deltas_in_one_call(llm, monkeypatch):
    """The engine process asks the engine for a step's deltas once (not once per request), and
    each delta reaches its submission and prompt: the deltas concatenate to the final outputs."""
    from nanoinfer.process.engine_process import EngineCore
    from nanoinfer.process.messages import Submit, pack_command

    commands, events = MemoryPipe(), MemoryPipe()
    core = EngineCore(llm, commands, events)
    calls = []
    take = llm.take_stream_deltas
    monkeypatch.setattr(llm, "take_stream_deltas", lambda ids: calls.append(1) or take(ids))
    monkeypatch.setattr(llm, "stream_deltas", lambda *a: pytest.fail("one call per request"))
    sp = SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, logprobs=1, stop=["e"])
    commands.send([pack_command(Submit(7, PROMPTS[:3], sp, True)),
                   pack_command(Submit(8, PROMPTS[3:], SamplingParams(max_tokens=5), True))])
    steps = drive_until_done(core, llm)
    assert len(calls) == steps
    prompt_of, texts, ids, finals = {}, {}, {}, {}  # prompt_of: request id -> (sub_id, prompt index)
    for news in events.items:
        for admission in news.admissions:
            assert admission.error is None
            prompt_of.update({rid: (admission.sub_id, i) for i, rid in enumerate(admission.request_ids)})
        for d in news.deltas:
            sub_id, i = prompt_of[d.request_id]
            assert d.index == i
            key = sub_id, i, d.completion_index
            texts[key] = texts.get(key, "") + d.text
            ids[key] = ids.get(key, []) + d.token_ids
        finals.update({prompt_of[out.request_id]: out for out in news.finals})
    assert set(finals) == {(7, 0), (7, 1), (7, 2), (8, 0)}
    for (sub_id, i), out in finals.items():
        for c in out.outputs:
            assert (texts[sub_id, i, c.index], ids[sub_id, i, c.index]) == (c.text, c.token_ids)
