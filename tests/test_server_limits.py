"""Issue 27 on the server: no single request holds up the others, and nothing is exposed that should
not be. A real `nanoinfer serve` process (tests/test_server.py's Server) with small limits:
- n beyond --max-n and over-long stop lists are 400s; a body over --max-request-body-bytes a 413;
- a request's chat_template renders only with --trust-request-chat-template, in a sandbox: a
  template bomb is cut off at the time limit while /health keeps answering within a second;
- Host headers other than the server's own names get a 421; /docs is off; /v1/models shows the
  served name, not a path;
- a connection that sends no request is closed after --header-timeout;
- a dead tensor-parallel rank makes /health 503 without any request;
- shutdown: a stream still running when --shutdown-timeout is over ends with an error event and
  [DONE], and a stuck (stopped) engine still lets the server exit promptly."""
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from test_server import NAME, Server, descendants, engine_pid, running, wait_until

openai = pytest.importorskip("openai")

LIMITS = {"max_n": 8, "max_request_body_bytes": 100_000, "chat_template_timeout": 2, "header_timeout": 2}
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("limits") / "server.log", trust_request_chat_template=True,
                 **LIMITS)
    yield srv
    srv.stop()


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def test_n_and_stop_lists_are_bounded(server):
    for n in (9, 100_000):
        r = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 4, "n": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "at most 8" in r.text
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, "stop": ["a" * 2000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    for logprobs in (21, -1):  # -1 is the whole vocabulary: over any limit but --max-logprobs -1
        r = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, "logprobs": logprobs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs" and "at most 20" in r.text
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, "n": 8})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_a_prompt_that_cannot_be_encoded_is_400(server):
    """Tokenized in the HTTP process now: its errors are still the client's 400."""
    r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                   content=b'{"model": "tiny", "prompt": "a lone surrogate \\ud800", "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_large_body_is_413(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "x " * 100_000, "max_tokens": 2})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the bytes are counted as they arrive
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(30):
            yield b"y " * 5000
        yield b'", "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_request_template_renders_in_the_sandbox(server, llm_for_templates):
    messages = [{"role": "user", "content": "Hello there"}]
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 6,
                                              "temperature": 0, "chat_template": TEMPLATE})
    assert r.status_code == 200, r.text
    want = llm_for_templates.chat(messages, chat_template=TEMPLATE, use_tqdm=False,
                                  sampling_params=_greedy(6))[0]
    assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text


def test_template_bomb_is_cut_off_while_health_answers(server):
    result = {}

    def bomb():
        t0 = time.monotonic()
        result["r"] = post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 2, "chat_template": BOMB,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        result["s"] = time.monotonic() - t0

    thread = threading.Thread(target=bomb)
    thread.start()
    time.sleep(0.3)
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.0, "/health stalled during a template render"
        time.sleep(0.2)
    r = result["r"]
    assert r.status_code == 400 and "within 2 s" in r.json()["error"]["message"], r.text
    assert result["s"] < 30
    for template in ("{{ 'a' * 100000000000 }}", "{{ 1 / 0 }}"):  # memory bomb, runtime error
        r = post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 2, "chat_template": template,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
    # the sandbox was replaced: request templates still render
    r = post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 2, "chat_template": TEMPLATE,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_host_docs_and_model_name(server, tiny_qwen3):
    assert httpx.get(server.url + "/health", headers={"host": "evil.example:8000"}, timeout=10).status_code == 421
    assert httpx.get(server.url + "/health", headers={"host": f"localhost:{server.port}"}, timeout=10).status_code == 200
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(server.url + path, timeout=10).status_code == 404
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME] and tiny_qwen3 not in str(models)
    assert os.sep not in models["data"][0]["root"]


def test_a_silent_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server, nothing sent
        assert time.monotonic() - t0 < 15
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
        assert s.recv(1) == b""


def test_a_dead_rank_makes_health_503(tiny_qwen3, tmp_path):
    srv = Server(tiny_qwen3, tmp_path / "server.log", tensor_parallel_size=2)
    try:
        engine = engine_pid(srv.proc.pid)
        workers = [p for p in descendants(engine) if running(p)]
        assert workers
        os.kill(workers[-1], signal.SIGKILL)
        wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 503, timeout=30,
                   what="/health to report the dead rank")
        r = post(srv, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "Traceback" not in r.text and "/" not in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def test_shutdown_cuts_streams_with_an_error_event_and_done(tiny_qwen3, tmp_path):
    srv = Server(tiny_qwen3, tmp_path / "server.log", shutdown_timeout=2)
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                          json={"model": NAME, "prompt": "hi", "max_tokens": 3000, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2] and "shutting down" in rest[-2], rest[-3:]
        assert srv.proc.wait(timeout=60) == 0, srv.log()[-3000:]
        assert time.monotonic() - t0 < 20
    finally:
        srv.stop()


def test_shutdown_with_a_stuck_engine_is_bounded(tiny_qwen3, tmp_path):
    srv = Server(tiny_qwen3, tmp_path / "server.log", shutdown_timeout=2)
    engine = engine_pid(srv.proc.pid)
    try:
        os.kill(engine, signal.SIGSTOP)  # stuck: it answers nothing
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=60)
        assert time.monotonic() - t0 < 2 + 20
        wait_until(lambda: not running(engine), timeout=30, what="the stuck engine to be killed")
    finally:
        if running(engine):
            os.kill(engine, signal.SIGKILL)
        srv.stop()


# ---- helpers ------------------------------------------------------------------------------------
def _greedy(n):
    from nanoinfer import SamplingParams
    return SamplingParams(temperature=0, max_tokens=n)


@pytest.fixture(scope="module")
def llm_for_templates(tiny_qwen3):
    from nanoinfer import LLM
    from test_server import OPTIONS
    engine = LLM(tiny_qwen3, **OPTIONS)
    yield engine
    engine.exit()
