"""Image intake (multimodal/processor.py) and chat image parts (multimodal/chat_parts.py,
multimodal/media.py): vLLM's input API, the URL rules, and every bad input a clear error."""
import base64
import io
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.multimodal.media import MediaLoader
from vl_reference import random_image

P = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_vl_checkpoint, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("media")
    engine = LLM(make_vl_checkpoint(), device="cpu", kvcache_block_size=16, max_model_len=256,
                 allowed_local_media_path=str(media_dir))
    engine.media_dir = media_dir
    yield engine
    engine.exit()


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def gen(llm, prompt, images=None, **extra):
    request = {"prompt": prompt, **extra}
    if images is not None:
        request["multi_modal_data"] = {"image": images}
    return llm.generate(request, GREEDY, use_tqdm=False)[0]


# ---- generate's multi_modal_data -----------------------------------------------------------------
def test_single_image_or_list(llm):
    image = random_image(80, 60, seed=1)
    assert gen(llm, f"{P} hi", image).outputs[0].token_ids == gen(llm, f"{P} hi", [image]).outputs[0].token_ids


@pytest.mark.parametrize("prompt, images, match", [
    (f"{P} and {P}", [random_image(50, 50)], "2 image placeholder"),
    ("no placeholder", [random_image(50, 50)], "0 image placeholder"),
    (f"{P} alone", None, "1 image placeholder"),
    (f"{P}", [], "empty list"),
    (f"{P}", [None], "PIL.Image"),
    (f"{P}", "not an image", "PIL.Image"),
    ("<|vision_start|><|video_pad|><|vision_end|>", [], "empty list"),
])
def test_bad_images_and_placeholders(llm, prompt, images, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gen(llm, prompt, images)


def test_empty_and_oversized_images(llm):
    from PIL import Image
    with pytest.raises(ValueError, match="empty"):
        gen(llm, P, Image.new("RGB", (0, 0)))
    # more image tokens than max_model_len (256): six images of 49 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        gen(llm, P * 6, [random_image(300, 300, seed=i) for i in range(6)])
    assert gen(llm, "still serving").outputs[0].token_ids  # the engine goes on


def test_video_and_unknown_modalities_refused(llm):
    with pytest.raises(ValueError, match="video"):
        gen(llm, "<|vision_start|><|video_pad|><|vision_end|>")
    with pytest.raises(ValueError, match="not supported"):
        llm.generate({"prompt": P, "multi_modal_data": {"video": [1]}}, GREEDY, use_tqdm=False)


def test_mm_processor_kwargs_checked(llm):
    image = random_image(100, 100)
    for kwargs, match in (({"bogus": 1}, "not supported"), ({"max_pixels": -1}, "positive int"),
                          ({"min_pixels": 5000, "max_pixels": 1000}, "exceeds")):
        with pytest.raises(ValueError, match=match):
            gen(llm, P, image, mm_processor_kwargs=kwargs)
    with pytest.raises(TypeError, match="multi_modal_data"):
        llm.generate({"prompt": P, "multi_modal_data": [image]}, GREEDY, use_tqdm=False)


def test_truncation_cannot_cut_images(llm):
    sp = SamplingParams(max_tokens=2, truncate_prompt_tokens=4)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt": f"{P} some text", "multi_modal_data": {"image": random_image(60, 60)}}, sp,
                     use_tqdm=False)


def test_text_model_refuses_images(make_llm, tiny_qwen3):
    text = make_llm(tiny_qwen3, device="cpu", kvcache_block_size=16, max_model_len=128)
    try:
        with pytest.raises(ValueError, match="takes no images"):
            text.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(20, 20)}}, use_tqdm=False)
    finally:
        text.exit()


# ---- chat image parts ----------------------------------------------------------------------------
def chat_text(llm, content_text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content_text}], tokenize=False,
                                             add_generation_prompt=True)


def test_chat_data_url_equals_generate_with_pil(llm):
    image = random_image(90, 70, seed=7)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What is this?"}]}]
    got = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    want = gen(llm, chat_text(llm, f"{P}\nWhat is this?"), image)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "What is this?"}]}], GREEDY,
                   use_tqdm=False)[0]
    assert pil.outputs[0].token_ids == want.outputs[0].token_ids


def test_chat_file_url_under_allowed_path(llm, tmp_path):
    image = random_image(64, 64, seed=8)
    inside = llm.media_dir / "a.png"
    inside.write_bytes(png_bytes(image))
    part = {"type": "image_url", "image_url": {"url": f"file://{inside}"}}
    got = llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == gen(llm, chat_text(llm, P), image).outputs[0].token_ids
    outside = tmp_path / "b.png"
    outside.write_bytes(png_bytes(image))
    escape = llm.media_dir / "link.png"
    os.symlink(outside, escape)
    for url in (f"file://{outside}", f"file://{escape}", f"file://{llm.media_dir}/../{outside.name}"):
        with pytest.raises(ValueError, match="outside allowed_local_media_path"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                     use_tqdm=False)


class _Counting(BaseHTTPRequestHandler):
    hits = []
    body = b""

    def do_GET(self):
        _Counting.hits.append(self.path)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(_Counting.body)))
        self.end_headers()
        self.wfile.write(_Counting.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_image():
    image = random_image(40, 40, seed=9)
    _Counting.hits, _Counting.body = [], png_bytes(image)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield image, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_url_rules(http_image, tmp_path):
    image, base = http_image
    refused = MediaLoader()
    for url, match in ((f"{base}/img.png", "allowed_media_domains"),
                       ("file:///etc/hostname", "allowed_local_media_path"), ("ftp://example.com/a.png", "not allowed"), ("img.png", "not allowed"),
                       ("data:text/plain;base64,aGk=", "data:image"), ("data:image/png;base64,@@@", "base64"),
                       ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a readable image")):
        with pytest.raises(ValueError, match=match):
            refused.load_image(url)
    assert _Counting.hits == []  # nothing was fetched for a refused host
    allowed = MediaLoader(allowed_media_domains=["127.0.0.1"])
    assert allowed.load_image(f"{base}/img.png").tobytes() == image.tobytes()
    with pytest.raises(ValueError, match="HTTP 302"):
        allowed.load_image(f"{base}/redirect")
    assert _Counting.hits == ["/img.png", "/redirect"]  # the redirect was not followed
    with pytest.raises(ValueError, match="not a directory"):
        MediaLoader(allowed_local_media_path=str(tmp_path / "missing"))


class _Dripping(BaseHTTPRequestHandler):
    """Answers 200, then one byte every 0.05 s for 8 s: each read is quick, the whole is slow."""
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        stop = threading.Event()
        try:
            for _ in range(160):
                stop.wait(0.05)
                self.wfile.write(b"x")
                self.wfile.flush()
        except OSError:  # the client gave up
            pass

    def log_message(self, *args):
        pass


def test_fetch_has_a_total_deadline(monkeypatch):
    """FETCH_TIMEOUT_S bounds the whole fetch, not each read: a server dripping bytes cannot hold
    a render thread for ever."""
    import time
    from nanoinfer.multimodal import media
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.5)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dripping)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="within 0.5 s"):
            MediaLoader(allowed_media_domains=["127.0.0.1"]).load_image(
                f"http://127.0.0.1:{server.server_address[1]}/slow.png")
        assert time.monotonic() - start < 5
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.parametrize("url", ["http://127.0.0.1/\x00.png", "http://127.0.0.1:abc/a.png"])
def test_malformed_allowed_url_is_a_value_error(url):
    """httpx's InvalidURL is no httpx.HTTPError: it reached the server as a 500."""
    with pytest.raises(ValueError, match="image URL"):
        MediaLoader(allowed_media_domains=["127.0.0.1"]).load_image(url)


def test_chat_refused_url_names_the_part(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]\[1\].*allowed_media_domains"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                               {"type": "image_url", "image_url": {"url": "http://x.org/a.png"}}]}],
                 use_tqdm=False)


def test_media_options_checked(make_vl_checkpoint, tmp_path):
    from nanoinfer.config import Config
    path = make_vl_checkpoint()
    with pytest.raises(TypeError, match="allowed_media_domains"):
        Config.from_options(path, allowed_media_domains=[3])
    with pytest.raises(ValueError, match="not a directory"):
        Config.from_options(path, allowed_local_media_path=str(tmp_path / "nowhere"))
    config = Config.from_options(path, allowed_media_domains=["a.org"], allowed_local_media_path=str(tmp_path))
    assert config.hf_config.vision_config is not None and config.hf_config.vocab_size > 0


def test_decompression_bomb_refused(monkeypatch):
    from nanoinfer.multimodal import media
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ValueError, match="more than 100"):
        MediaLoader().load_image(data_url(random_image(20, 20)))


def test_all_images_of_a_conversation_share_one_pixel_budget(llm, monkeypatch):
    """Each image within MAX_IMAGE_PIXELS is not enough: a 186 kB PNG decodes to 192 MB, so one 8 MB
    body could hold 40 of them (7.7 GB in the HTTP process). The conversation's images together are
    bounded, each refused before it is decoded once the budget is spent."""
    from nanoinfer.multimodal import media
    from nanoinfer.chat import render_chat
    monkeypatch.setattr(media, "MAX_REQUEST_PIXELS", 4000)
    part = {"type": "image_url", "image_url": {"url": data_url(random_image(40, 40, seed=1))}}  # 1600 pixels
    loader, tok = MediaLoader(), llm.get_tokenizer()
    two = render_chat(tok, [{"role": "user", "content": [part, part]}], media=loader)
    assert len(two["multi_modal_data"]["image"]) == 2
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\]\[0\].*4000 pixels"):
        render_chat(tok, [{"role": "user", "content": [part, part]}, {"role": "user", "content": [part]}],
                    media=loader)
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]\[2\].*4000 pixels in all"):
        pil = {"type": "image_pil", "image_pil": random_image(40, 40)}
        render_chat(tok, [{"role": "user", "content": [pil, pil, pil]}], media=loader)


def test_template_probe_cache_is_bounded(llm):
    """The probe's cache of templates stays small: with --trust-request-chat-template every request
    may bring its own template (up to the body limit), which the sandbox process would otherwise
    keep for ever until it runs out of memory."""
    from nanoinfer.multimodal import chat_parts
    tok = llm.get_tokenizer()
    for i in range(3 * chat_parts.TAKES_PARTS_CACHE_SIZE):
        template = f"{{{{ messages[0]['content'] }}}} {i} " + "x" * 10000
        assert chat_parts.template_takes_parts(tok, template) is False
    assert len(chat_parts._TAKES_PARTS) <= chat_parts.TAKES_PARTS_CACHE_SIZE
    assert all(len(repr(key)) < 200 for key in chat_parts._TAKES_PARTS)  # keys hold no template text


QWEN_VL_STYLE_TEMPLATE = (  # renders content parts itself, as Qwen2-VL's own template does
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_that_renders_parts_writes_the_placeholders(llm):
    image = random_image(70, 70, seed=12)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "what?"}]}]
    got = llm.chat(messages, GREEDY, chat_template=QWEN_VL_STYLE_TEMPLATE, use_tqdm=False)[0]
    text = f"<|im_start|>user\nLook:{P}what?<|im_end|>\n<|im_start|>assistant\n"
    want = gen(llm, text, image)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("change, match", [
    ({"vision_config": {"depth": 0}}, "vision_config.depth"),
    ({"vision_config": {"num_heads": 3}}, "num_heads=3"),
    ({"vision_config": {"out_hidden_size": 48}}, "out_hidden_size=48"),
    ({"image_token_id": 100000}, "image_token_id"),
    # a window narrower than one merged patch: HF divides by zero; we failed each image request
    ({"vision_config": {"window_size": 14}}, "vision_config.window_size=14"),
    ({"vision_config": {"hidden_act": "gelu"}}, "vision_config.hidden_act 'gelu'"),  # ran as SiLU
])
def test_bad_vision_config_refused(make_vl_checkpoint, tmp_path, change, match):
    import json
    import shutil
    src = make_vl_checkpoint()
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        LLM(str(dst), device="cpu", kvcache_block_size=16, max_model_len=128)


def test_batch_with_a_bad_image_queues_none(llm):
    """Several image prompts are preprocessed together (threads); one bad image rejects the batch,
    naming its index, and the engine goes on."""
    good = {"prompt": f"{P} one", "multi_modal_data": {"image": random_image(60, 60, seed=1)}}
    bad = {"prompt": f"{P} two", "multi_modal_data": {"image": "not an image"}}
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate([good, bad, good], GREEDY, use_tqdm=False)
    assert llm.is_finished()
    outs = llm.generate([good, good], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == \
        gen(llm, f"{P} one", random_image(60, 60, seed=1)).outputs[0].token_ids


@pytest.mark.parametrize("value, error, match", [
    ('{"image": -1}', ValueError, r"limit_mm_per_prompt\['image'\] must be >= 0"),
    ({"image": 1.5}, TypeError, r"limit_mm_per_prompt\['image'\] must be an int"),
    ({"image": True}, TypeError, r"limit_mm_per_prompt\['image'\] must be an int"),
    ({"picture": 1}, ValueError, "unknown modality 'picture'"),
    ("{image: 1}", ValueError, "not valid JSON"),
    ([1], TypeError, "must be a dict"),
])
def test_limit_mm_per_prompt_checked(make_vl_checkpoint, value, error, match):
    from nanoinfer.config import Config
    with pytest.raises(error, match=match):
        Config.from_options(make_vl_checkpoint(), limit_mm_per_prompt=value)


def test_limit_mm_per_prompt_bounds_a_prompts_images(make_vl_checkpoint):
    """vLLM's option: at most N images a prompt (JSON text as on the command line, or a dict; its
    {"count": N} form too); a prompt over it is a ValueError and queues nothing; 0 refuses images;
    the video key is taken (and videos stay unsupported)."""
    image = random_image(50, 50, seed=2)
    llm = LLM(make_vl_checkpoint(), device="cpu", kvcache_block_size=16, max_model_len=256,
              limit_mm_per_prompt='{"image": {"count": 1}, "video": 0}')
    try:
        assert llm.config.limit_mm_per_prompt == {"image": 1, "video": 0}
        assert len(gen(llm, f"{P} one", image).outputs[0].token_ids) == 5
        with pytest.raises(ValueError, match=r"the prompt has 2 image\(s\); limit_mm_per_prompt allows at most 1"):
            llm.generate([{"prompt": f"{P} ok", "multi_modal_data": {"image": image}},
                          {"prompt": f"{P}{P} two", "multi_modal_data": {"image": [image, image]}}], GREEDY,
                         use_tqdm=False)
        assert llm.is_finished(), "the batch with a prompt over the limit queues none of its prompts"
    finally:
        llm.exit()
    llm = LLM(make_vl_checkpoint(), device="cpu", kvcache_block_size=16, max_model_len=256,
              limit_mm_per_prompt={"image": 0})
    try:
        with pytest.raises(ValueError, match="allows at most 0"):
            gen(llm, f"{P} none", image)
        assert len(llm.generate("text only", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5
    finally:
        llm.exit()


def test_image_key_follows_everything_that_makes_the_patches():
    """The prefix and encoder caches key an image by its source: equal images under equal pixel
    bounds share a key; another pixel, mode, size, palette or bound gives another key."""
    from PIL import Image

    from nanoinfer.multimodal.processor import image_key
    bounds = {"shortest_edge": 3136, "longest_edge": 50176}
    image = random_image(40, 30, seed=1)
    assert image_key(image, bounds) == image_key(image.copy(), dict(bounds))
    changed = image.copy()
    changed.putpixel((3, 4), tuple((c + 1) % 256 for c in image.getpixel((3, 4))))
    others = [changed, image.convert("RGBA"), image.resize((30, 40)), random_image(40, 30, seed=2)]
    keys = {image_key(image, bounds)} | {image_key(other, bounds) for other in others}
    keys.add(image_key(image, {**bounds, "longest_edge": 40000}))
    assert len(keys) == 6
    indexed = Image.new("P", (8, 8))
    indexed.putpalette([0, 0, 0] * 256)
    repainted = indexed.copy()
    repainted.putpalette([255, 0, 0] * 256)  # the same indices, other colours
    assert image_key(indexed, bounds) != image_key(repainted, bounds)
