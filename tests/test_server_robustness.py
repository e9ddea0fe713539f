"""Issue 50 on the server: no single request may stall the others. A real `nanoinfer serve` process
(tests/test_server.py's Server); each attack below is a reproduction from the issue, and during each
/health answers within a second, and afterwards the server gives the same greedy text as before:
- a list of prompts cannot multiply n past --max-seqs-per-request;
- a text prompt longer than max_model_len could hold is refused before it is tokenized, and long
  prompts that are tokenized do not hold up a short request's;
- request templates render side by side: timed-out bombs do not delay a legitimate render;
- a body sent a byte at a time is cut off at --request-body-timeout;
- a malformed logit_bias key, a model name with a lone surrogate, and min_tokens past the default
  max_tokens are 4xx, not 500s or a generation to max_model_len."""
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_server import NAME, Server

pytest.importorskip("openai")

LIMITS = {"max_seqs_per_request": 64, "chat_template_timeout": 2, "request_body_timeout": 2}
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"
GREEDY = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("robust") / "server.log", trust_request_chat_template=True,
                 **LIMITS)
    srv.greedy = post(srv, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    yield srv
    srv.stop()


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def chat(content="hi", **fields):
    return {"model": NAME, "messages": [{"role": "user", "content": content}], **fields}


def during(server, attack, *args) -> list:
    """Run attack(*args) in threads (one per argument) while /health is asked every 0.2 s: each
    answer within a second. Returns the attacks' results, and checks the greedy text afterwards."""
    with ThreadPoolExecutor(len(args)) as pool:
        futures = [pool.submit(attack, a) for a in args]
        while not all(f.done() for f in futures):
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            assert time.monotonic() - t0 < 1.0, "/health stalled during the attack"
            time.sleep(0.2)
        results = [f.result() for f in futures]
    assert post(server, "/v1/completions", GREEDY).json()["choices"][0]["text"] == server.greedy
    return results


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


def test_a_list_of_prompts_cannot_multiply_n(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [[5]] * 2000, "n": 128, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text[:500]
    assert "at most 64" in r.text and "--max-seqs-per-request" in r.text and "2000 prompts x n=128" in r.text
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [[5]] * 65, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 64" in r.text, r.text[:500]
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [[5]] * 9, "n": 8, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text[:500]
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [[5]] * 8, "n": 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 64, r.text[:500]


def test_a_huge_text_prompt_is_refused_before_it_is_tokenized(server, tiny_qwen3):
    from transformers import AutoTokenizer
    text = "ab " * 700_000
    _, tokenizing = timed(AutoTokenizer.from_pretrained(tiny_qwen3).encode, text)
    r, refusing = timed(post, server, "/v1/completions", {"model": NAME, "prompt": text, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:500]
    assert "--max-prompt-chars" in r.text and "2100000 characters" in r.text
    print(f"refused in {refusing:.3f} s; tokenizing it takes {tokenizing:.3f} s")
    assert refusing < tokenizing / 3
    for body in (chat("ab " * 30_000, max_tokens=2), {"model": NAME, "prompt": "ab " * 30_000}):
        r = post(server, "/v1/chat/completions" if "messages" in body else "/tokenize", body)
        assert r.status_code == 400, r.text[:500]


def test_long_prompts_do_not_hold_up_a_short_one(server):
    """Four requests of many prompts as long as the limit allows (each ends in a 400 at its last
    prompt, a lone surrogate, once the others are tokenized), and meanwhile 5-token requests: those
    are not queued behind them."""
    body = ('{"model": "tiny", "max_tokens": 1, "prompt": [' + ('"' + "ab " * 16_000 + '", ') * 40 +
            '"\\ud800"]}').encode()
    left = [4]
    done = threading.Event()

    def short() -> float:
        return timed(post, server, "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 1})[1]

    def attack(long: bool):
        if not long:
            times = [short()]
            while not done.is_set():
                times.append(short())
            return max(times)
        try:
            return timed(httpx.post, server.url + "/v1/completions", content=body, timeout=300,
                         headers={"content-type": "application/json"})
        finally:
            left[0] -= 1  # (under the GIL: one thread at a time)
            if not left[0]:
                done.set()

    alone = max(short() for _ in range(3))
    *longs, beside = during(server, attack, True, True, True, True, False)
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "prompt" for r, _ in longs), longs[0][0].text
    slowest = max(seconds for _, seconds in longs)
    print(f"a short request: {alone:.3f} s alone, {beside:.3f} s at most beside long ones, which took {slowest:.3f} s")
    assert beside < slowest / 4


def test_request_templates_render_side_by_side(server):
    """Three template bombs (cut off at 2 s each) and, while they run, a legitimate template."""
    def render(template):
        if template is TEMPLATE:
            time.sleep(0.5)  # the bombs are rendering
        return timed(post, server, "/v1/chat/completions", chat(max_tokens=2, chat_template=template))

    results = during(server, render, BOMB, BOMB, BOMB, TEMPLATE)
    for r, _ in results[:3]:
        assert r.status_code == 400 and "within 2 s" in r.json()["error"]["message"], r.text[:500]
    (good, seconds), bomb = results[3], min(s for _, s in results[:3])
    assert good.status_code == 200, good.text
    print(f"a legitimate render beside three bombs: {seconds:.3f} s; a bomb: {bomb:.3f} s")
    assert seconds < bomb * 0.75  # (one bomb ahead of it would take it past its whole time limit)


def test_a_trickled_body_is_cut_off(server):
    def trickle(_):
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            while True:  # one byte a second: each within the header timeout, never the whole body
                try:
                    s.settimeout(1.0)
                    return s.recv(1), time.monotonic() - t0
                except (ConnectionResetError, BrokenPipeError):
                    return b"", time.monotonic() - t0
                except TimeoutError:
                    try:
                        s.sendall(b" ")
                    except (ConnectionResetError, BrokenPipeError):
                        return b"", time.monotonic() - t0
                if time.monotonic() - t0 > 50:
                    return None, None

    results = during(server, trickle, *range(30))
    assert all(data == b"" and seconds is not None for data, seconds in results), "a trickling connection stayed open"
    print(f"trickling connections closed after {max(s for _, s in results):.1f} s")


def test_malformed_fields_are_4xx(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, "logit_bias": {"--5": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and "'--5'" in r.text, r.text[:500]
    r = httpx.post(server.url + "/v1/completions", headers={"content-type": "application/json"}, timeout=60,
                   content=b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}')
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text[:500]
    for route, body in (("/v1/chat/completions", chat(min_tokens=10**30)),
                        ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": None, "min_tokens": 5000})):
        r = post(server, route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text[:500]
        assert "defaults to max_model_len" in r.text
