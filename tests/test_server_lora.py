"""LoRA adapters over HTTP (serve/lora_modules.py, serve/app.py): `--enable-lora --lora-modules
NAME=PATH ...` serves each adapter under its own model name, /v1/models lists them with the base as
their parent, a request's `model` selects its adapter (the same tokens as the offline API under
that LoRARequest), an unknown name is a 404, and a bad adapter a 400 naming the tensor."""
import os

import httpx
import pytest

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.serve.lora_modules import parse_lora_modules

from lora_reference import make_adapter
from test_server import NAME, OPTIONS, Server

openai = pytest.importorskip("openai")

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_adapters")
    good = [make_adapter(tiny_qwen3, str(root / f"ad{i}"), r=8, seed=i) for i in (1, 2)]
    bad = make_adapter(tiny_qwen3, str(root / "too_high"), ["q_proj"], r=16, seed=3)
    return {"ad1": good[0], "ad2": good[1], "too-high": bad}


@pytest.fixture(scope="module")
def server(tiny_qwen3, adapters, tmp_path_factory):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("lora_server") / "server.log",
                 extra_args=("--lora-modules", *modules), allow_runtime_lora_updating=True, **LORA)
    yield srv
    srv.stop()


def test_models_lists_the_adapters(server, adapters):
    cards = {m.id: m for m in server.client().models.list().data}
    assert set(cards) == {NAME, *adapters}
    assert cards["ad1"].root == adapters["ad1"] and cards["ad1"].parent == NAME
    assert server.client().models.retrieve("ad2").parent == NAME


def test_model_name_selects_the_adapter(server, adapters, tiny_qwen3):
    client = server.client()
    prompts = ["Hello, my name is", "The quick brown fox"]
    llm = LLM(tiny_qwen3, **OPTIONS, **LORA)
    try:
        for model, lora in [(NAME, None), ("ad1", LoRARequest("ad1", 1, adapters["ad1"])),
                            ("ad2", LoRARequest("ad2", 2, adapters["ad2"]))]:
            expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                                                 use_tqdm=False, lora_request=lora)]
            out = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0)
            assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected, model
            assert out.model == model
        assert len({tuple(o.outputs[0].token_ids) for o in llm.generate(
            prompts[:1] * 3, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
            lora_request=[None, LoRARequest("ad1", 1, adapters["ad1"]), LoRARequest("ad2", 2, adapters["ad2"])])}) > 1
        chat = client.chat.completions.create(model="ad1", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.model == "ad1" and chat.usage.completion_tokens == 4
    finally:
        llm.exit()


def test_unknown_model_is_404_and_a_bad_adapter_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "too-high", "prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400
    assert "q_proj.lora_A.weight: rank 16 exceeds max_lora_rank=8" in r.json()["error"]["message"]
    out = server.client().completions.create(model="ad1", prompt="Hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2, "the server keeps serving"


def test_adapters_load_and_unload_at_runtime(server, adapters):
    post = lambda route, body: httpx.post(server.url + route, json=body, timeout=60)  # noqa: E731
    r = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["ad2"]})
    assert r.status_code == 200 and "added successfully" in r.text
    assert "late" in {m.id for m in server.client().models.list().data}
    late = server.client().completions.create(model="late", prompt="Hello", max_tokens=6, temperature=0)
    ad2 = server.client().completions.create(model="ad2", prompt="Hello", max_tokens=6, temperature=0)
    assert late.choices[0].text == ad2.choices[0].text, "the same adapter under another name"
    r = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["ad1"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "nowhere", "lora_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    # no file-system probe: a file, a directory without a config and nothing at all get one message
    messages = {post("/v1/load_lora_adapter", {"lora_name": "probe", "lora_path": path}).json()["error"]["message"]
                .replace(repr(path), "PATH") for path in (__file__, os.path.dirname(__file__), "/no/such/dir")}
    assert len(messages) == 1, messages
    assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    r = post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    r = post("/v1/completions", {"model": "late", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 404


def test_runtime_updating_routes_exist_only_when_allowed():
    from types import SimpleNamespace
    from nanoinfer.serve.app import build_app
    engine = SimpleNamespace(tokenizer=None, summary={})
    routes = lambda app: {r.path for r in app.routes}  # noqa: E731
    assert "/v1/load_lora_adapter" not in routes(build_app(engine, "m", renderer=object()))
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= \
        routes(build_app(engine, "m", renderer=object(), allow_lora_updating=True))


def test_lora_modules_flag_forms():
    a, b = parse_lora_modules(["x=/p/x", '{"name": "y", "path": "/p/y", "base_model_name": "base"}'])
    assert (a.lora_name, a.lora_int_id, a.lora_path) == ("x", 1, "/p/x")
    assert (b.lora_name, b.lora_int_id, b.lora_path, b.base_model_name) == ("y", 2, "/p/y", "base")
    for bad, match in [(["x"], "NAME=PATH"), (["x=/a", "x=/b"], "given twice"), (['{"name": "y"}'], "JSON")]:
        with pytest.raises(ValueError, match=match):
            parse_lora_modules(bad)


def test_lora_modules_need_enable_lora(tiny_qwen3, capsys):
    from nanoinfer.serve.cli import main
    assert main(["serve", tiny_qwen3, "--port", "0", "--lora-modules", "x=/p/x"]) == 2
    assert "--lora-modules and --allow-runtime-lora-updating need --enable-lora" in capsys.readouterr().err
