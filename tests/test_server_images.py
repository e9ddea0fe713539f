"""The server's chat completions with OpenAI image_url parts (a real server process, the openai client)."""
import pytest

openai = pytest.importorskip("openai")

from nanoinfer import LLM, SamplingParams  # noqa: E402
from test_multimodal import data_url  # noqa: E402
from test_server import NAME, OPTIONS, Server  # noqa: E402
from vl_reference import random_image  # noqa: E402


@pytest.fixture(scope="module")
def vl_server(make_vl_checkpoint, tmp_path_factory):
    srv = Server(make_vl_checkpoint(), tmp_path_factory.mktemp("server") / "server.log", max_model_len=512)
    yield srv
    srv.stop()


@pytest.mark.timeout(900)
def test_chat_with_image_url(vl_server, make_vl_checkpoint):
    image = random_image(96, 72, seed=4)
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "What is it?"}]
    client = vl_server.client()
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                           max_tokens=6, temperature=0)
    llm = LLM(make_vl_checkpoint(), **{**OPTIONS, "max_model_len": 512})
    try:
        want = llm.chat([{"role": "user", "content": content}], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)[0]
    finally:
        llm.exit()
    assert reply.choices[0].message.content == want.outputs[0].text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    for url, match in (("http://example.invalid/a.png", "allowed_media_domains"),
                       ("data:image/png;base64,bm90IGFuIGltYWdl", "not a readable image"),
                       ("file:///etc/hostname", "allowed_local_media_path")):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model=NAME, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    with pytest.raises(openai.BadRequestError, match="image placeholder"):
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[
            {"role": "user", "content": f"two {'<|vision_start|><|image_pad|><|vision_end|>'}"}])
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).usage.completion_tokens == 2  # still serving


@pytest.mark.timeout(600)
def test_request_chat_template_renders_images(make_vl_checkpoint):
    """--trust-request-chat-template: a request's own template renders in the sandbox process, which
    had no media loader, so every image part was refused as if the model could not take images."""
    import asyncio
    from transformers import AutoTokenizer
    from nanoinfer.multimodal.media import MediaLoader
    from nanoinfer.serve.chat_renderer import ChatRenderer
    from test_multimodal import QWEN_VL_STYLE_TEMPLATE
    image = random_image(32, 32, seed=2)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What is it?"}]}]
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(make_vl_checkpoint()), trust_request_templates=True,
                            timeout_s=60, media=MediaLoader())
    try:
        mine = asyncio.run(renderer.render(messages, chat_template=QWEN_VL_STYLE_TEMPLATE))
        own = asyncio.run(renderer.render(messages))
    finally:
        renderer.close()
    assert mine["prompt"].count("<|image_pad|>") == 1 and "What is it?" in mine["prompt"]
    for prompt in (mine, own):
        assert [im.tobytes() for im in prompt["multi_modal_data"]["image"]] == [image.tobytes()]
