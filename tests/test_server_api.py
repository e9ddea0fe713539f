"""The rest of the server a vLLM user expects (issue 25, part 3): --api-key, /metrics in
Prometheus' format, /v1/models/{id}, /tokenize, /detokenize, /version, logit_bias and echo over
HTTP, the port checked before the model loads, and SIGTERM to the whole process group draining the
requests in flight. A real `nanoinfer serve` process (tests/test_server.py's Server), the official
openai client."""
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from test_server import NAME, OPTIONS, PROMPTS, REPO, Server, descendants, offline, running, wait_until

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("api") / "server.log", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    from nanoinfer import LLM
    engine = LLM(tiny_qwen3, **OPTIONS)
    yield engine
    engine.exit()


def auth(key=KEY):
    return {"authorization": f"Bearer {key}"}


def test_api_key(server, client):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server.url + "/tokenize", timeout=30).status_code == 401
    for open_path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.url + open_path, timeout=30).status_code == 200
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_models_version_tokenize_detokenize(server, client, llm):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    from nanoinfer import __version__
    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": __version__}
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}, headers=auth(), timeout=30).json()
    assert r["tokens"] == llm.tokenizer.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == OPTIONS["max_model_len"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=auth(), timeout=30).json()
    assert back["prompt"] == llm.tokenizer.decode(r["tokens"])
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers=auth(), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(server.url + "/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
                      headers=auth(), timeout=30)
    assert both.status_code == 400


def test_logit_bias_and_echo(server, client, llm):
    banned = offline(llm, PROMPTS[1], max_tokens=6, temperature=0)["token_ids"][0]
    out = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                    logit_bias={str(banned): -100})
    want = offline(llm, PROMPTS[1], max_tokens=6, temperature=0, logit_bias={banned: -100})
    assert out.choices[0].text == want["text"] and banned not in want["token_ids"][:1]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=2, logit_bias={"abc": 1})
    # echo + logprobs (lm-eval-harness' log-likelihood): the prompt's text and its tokens' logprobs first
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=1, temperature=0, echo=True, logprobs=1)
    choice = choice0 = out.choices[0]
    ref = offline(llm, PROMPTS[2], max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    prompt_ids = ref.prompt_token_ids
    assert choice.text == PROMPTS[2] + ref["text"]
    lps = choice0.logprobs
    assert len(lps.tokens) == len(prompt_ids) + 1 and lps.token_logprobs[0] is None
    for p in range(1, len(prompt_ids)):
        assert lps.token_logprobs[p] == pytest.approx(ref.prompt_logprobs[p][prompt_ids[p]].logprob, abs=1e-5)
    assert "".join(lps.tokens) == choice.text


def test_metrics_scrape(server, client):
    for stream in (False, True):
        out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            list(out)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["nanoinfer:generation_tokens_total"].value >= 10
    assert samples["nanoinfer:prompt_tokens_total"].value > 0
    assert samples["nanoinfer:time_to_first_token_seconds_count"].value >= 2
    assert samples["nanoinfer:inter_token_latency_seconds_count"].value >= 1
    assert 0 <= samples["nanoinfer:kv_cache_usage_perc"].value <= 1
    for name in ("nanoinfer:num_requests_running", "nanoinfer:num_requests_waiting",
                 "nanoinfer:prefix_cache_queries_total", "nanoinfer:prefix_cache_hits_total"):
        assert name in samples
    assert samples["nanoinfer:num_requests_running"].labels["model_name"] == NAME


def test_a_port_in_use_is_reported_before_loading(tiny_qwen3):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "nanoinfer", "serve", tiny_qwen3, "--port", str(port)],
                           capture_output=True, text=True, timeout=120, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 2 and f"127.0.0.1:{port}" in r.stderr, r.stderr


def test_sigterm_to_the_process_group_drains(tiny_qwen3, tmp_path, llm):
    """`timeout` / systemd / Kubernetes signal every process of the group: the engine process and
    its tensor-parallel workers ignore it, and the server drains the request in flight."""
    srv = Server(tiny_qwen3, tmp_path / "server.log", new_session=True, tensor_parallel_size=2)
    children = descendants(srv.proc.pid)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        stream = iter(c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
        chunks = [next(stream)]
        os.killpg(srv.proc.pid, signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(ch.choices[0].text for ch in chunks) == \
            offline(llm, PROMPTS[0], max_tokens=40, temperature=0, ignore_eos=True)["text"]
        assert srv.proc.wait(timeout=120) == 0, srv.log()
    finally:
        srv.stop()
    wait_until(lambda: not [p for p in children if running(p)], timeout=60, what="the server's children to exit")

