"""/v1/embeddings on a real `nanoinfer serve --runner pooling` process, with the openai client,
against the offline API; the request body's `priority` (vLLM's extension)."""
import base64
import re
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from nanoinfer import LLM, PoolingParams  # noqa: E402
from test_server import NAME, OPTIONS, Server  # noqa: E402

TEXTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache stores"]


@pytest.fixture(scope="module")
def embed_server(tiny_qwen3, tmp_path_factory):
    server = Server(tiny_qwen3, tmp_path_factory.mktemp("log") / "server.log", runner="pooling",
                    scheduling_policy="priority", max_seqs_per_request=20000)  # (test_many_inputs_in_one_request)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(tiny_qwen3):
    options = {k: v for k, v in OPTIONS.items()}
    llm = LLM(tiny_qwen3, runner="pooling", **options)
    yield llm
    llm.exit()


def test_embeddings_create_equals_offline(embed_server, offline):
    client = embed_server.client()  # (it asks for base64 and decodes it into floats)
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    resp = client.embeddings.create(model=NAME, input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == NAME
    for d, w in zip(resp.data, want):
        assert np.allclose(d.embedding, w, atol=1e-5)
    ids = offline.tokenizer.encode(TEXTS[0])
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(offline.tokenizer.encode(t)) for t in TEXTS)
    one = client.embeddings.create(model=NAME, input=TEXTS[0])  # a string
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, want[0], atol=1e-5)
    by_ids = client.embeddings.create(model=NAME, input=ids)  # token ids
    assert np.allclose(by_ids.data[0].embedding, want[0], atol=1e-5)
    floats = client.embeddings.create(model=NAME, input=[ids, offline.tokenizer.encode(TEXTS[2])],
                                      encoding_format="float")
    assert isinstance(floats.data[0].embedding[0], float)
    assert np.allclose(floats.data[1].embedding, want[2], atol=1e-5)


def test_base64_dimensions_and_priority(embed_server, offline):
    client = embed_server.client()
    want = offline.embed(TEXTS[1], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    resp = client.embeddings.create(model=NAME, input=[TEXTS[1]], dimensions=16, encoding_format="base64",
                                    extra_body={"priority": -3})
    # (asked explicitly, the openai client leaves the base64 string as it came)
    assert np.allclose(np.frombuffer(base64.b64decode(resp.data[0].embedding), dtype="<f4"), want, atol=1e-5)
    raw = httpx.post(embed_server.url + "/v1/embeddings", timeout=60,
                     json={"input": TEXTS[1], "dimensions": 16, "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (16,) and np.allclose(vec, want, atol=1e-5)


@pytest.mark.parametrize("body,param", [({"input": ""}, "input"), ({"input": "x", "dimensions": 1000}, "dimensions"),
                                        ({"input": "x", "priority": 1.5}, "priority"),
                                        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                                        ({"input": [10**9]}, "input")])
def test_bad_requests_are_openai_400s(embed_server, body, param):
    r = httpx.post(embed_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and param in (err["param"] or "") + err["message"]


def test_an_input_of_max_model_len_tokens_embeds(embed_server, offline):
    """As offline: an embedding's input may fill max_model_len; one token more is a 400."""
    n = offline.config.max_model_len
    ids = [(7 * i) % 300 + 3 for i in range(n)]
    want = offline.embed([ids], use_tqdm=False)[0].outputs.embedding
    resp = embed_server.client().embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert np.allclose(resp.data[0].embedding, want, atol=1e-5)
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"input": ids + [5]}, timeout=60)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text


def test_many_inputs_in_one_request(embed_server, offline):
    """20000 inputs in one body (240 kB). The engine process sent each vector as a torch tensor,
    which crosses the pipe as shared memory with a file descriptor each: the reader thread died
    ("received 0 items of ancdata") and every request after hung."""
    ids = offline.tokenizer.encode(TEXTS[0])
    r = httpx.post(embed_server.url + "/v1/embeddings", timeout=300, json={"input": [ids] * 20000, "dimensions": 4})
    assert r.status_code == 200, r.text[:500]
    data = r.json()["data"]
    assert len(data) == 20000 and data[-1]["index"] == 19999
    want = offline.embed(TEXTS[0], PoolingParams(dimensions=4), use_tqdm=False)[0].outputs.embedding
    assert np.allclose(data[-1]["embedding"], want, atol=1e-5)
    assert len(embed_server.client().embeddings.create(model=NAME, input=TEXTS[1]).data) == 1  # still serving


def test_inputs_are_bounded_by_max_seqs_per_request(embed_server):
    r = httpx.post(embed_server.url + "/v1/embeddings", timeout=60, json={"input": [[5]] * 20001})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "at most 20000" in r.text and "--max-seqs-per-request" in r.text


def test_generation_on_a_pooling_server_is_a_400(embed_server):
    r = httpx.post(embed_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]
    assert httpx.get(embed_server.url + "/health", timeout=30).status_code == 200


def test_priority_reaches_the_engine_and_stats_are_logged(tiny_qwen3, tmp_path, monkeypatch):
    """A generation server without --scheduling-policy priority refuses a non-zero `priority` with a
    400 naming it (so the field reaches the engine), and serves priority 0. The server logs the
    engine's statistics by default (here every step)."""
    monkeypatch.setenv("NANOINFER_LOG_STATS_INTERVAL", "0")
    server = Server(tiny_qwen3, tmp_path / "server.log", log_level="info")
    try:
        url = server.url + "/v1/completions"
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "priority": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "scheduling_policy" in r.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "priority": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        deadline = time.monotonic() + 60
        while "Avg prompt throughput" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval: the line is written by the engine process after its step
        assert re.search(r"Avg generation throughput: [\d.]+ tokens/s, Running: \d+ reqs", server.log())
    finally:
        server.stop()


def test_an_adapter_name_embeds_under_its_adapter(tiny_qwen3, tmp_path):
    """`model` naming a --lora-modules adapter embeds under that adapter, as the offline
    embed(..., lora_request=) does; the base name gives the base model's embeddings."""
    from lora_reference import make_adapter

    from nanoinfer import LoRARequest
    path = make_adapter(tiny_qwen3, str(tmp_path / "ad"), r=8, seed=4)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    offline_llm = LLM(tiny_qwen3, runner="pooling", **OPTIONS, **lora)
    try:
        base = [o.outputs.embedding for o in offline_llm.embed(TEXTS, use_tqdm=False)]
        adapted = [o.outputs.embedding for o in offline_llm.embed(TEXTS, use_tqdm=False,
                                                                   lora_request=LoRARequest("ad", 1, path))]
    finally:
        offline_llm.exit()
    assert not np.allclose(base[0], adapted[0], atol=1e-3)  # the adapter changes the embedding
    server = Server(tiny_qwen3, tmp_path / "server.log", runner="pooling", extra_args=("--lora-modules", f"ad={path}"),
                    **lora)
    try:
        client = server.client()
        for model, want in ((NAME, base), ("ad", adapted)):
            got = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
            for d, w in zip(got.data, want):
                assert np.allclose(d.embedding, w, atol=1e-5), model
    finally:
        server.stop()
