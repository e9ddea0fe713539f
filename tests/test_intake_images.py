"""Image preprocessing off the engine loop (issue 50, "Medium 2"), offline with the tiny VL model: a
prompt's image token count is known from the image's size before queueing (length checks stay
synchronous), while resizing and normalising run in an intake thread; a slow image leaves the other
requests stepping and then gives the same tokens as alone; images over max_image_pixels are refused
before anything decodes or preprocesses them."""
import threading

import pytest

from nanoinfer.multimodal.feature import ImageFeature
from nanoinfer import LLM, SamplingParams
from nanoinfer.multimodal.media import MediaLoader
from test_multimodal import data_url
from vl_reference import random_image

P = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_vl_checkpoint):
    engine = LLM(make_vl_checkpoint(), device="cpu", kvcache_block_size=16, max_model_len=256,
                 max_image_pixels=200 * 200)
    yield engine
    engine.exit()


def image_request(image):
    return {"prompt": f"{P} describe", "multi_modal_data": {"image": image}}


def test_slow_image_leaves_the_batch_stepping(llm, monkeypatch):
    image = random_image(120, 90, seed=3)
    alone_image = llm.generate(image_request(image), GREEDY, use_tqdm=False)[0]
    alone_text = llm.generate("plain text", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    processor = llm.feature(ImageFeature).processor
    gate, started, real = threading.Event(), threading.Event(), processor._preprocess

    def slow_preprocess(images, kwargs):
        started.set()
        assert gate.wait(120)
        return real(images, kwargs)

    monkeypatch.setattr(processor, "_preprocess", slow_preprocess)
    held = llm.add_request(image_request(image), GREEDY, keep_output=True)
    # the prompt's length is known before the pixels are: its placeholder is expanded already
    assert llm.get_output(held).prompt_token_ids == alone_image.prompt_token_ids
    plain = llm.add_request("plain text", GREEDY, keep_output=True)
    assert started.wait(60)
    while not llm.get_output(plain).finished:
        llm.step()
    assert llm.pop_output(plain).outputs[0].token_ids == alone_text
    assert not llm.get_output(held).finished and llm.get_output(held).outputs[0].token_ids == []
    gate.set()
    while not llm.is_finished():
        llm.step()
    assert llm.pop_output(held).outputs[0].token_ids == alone_image.outputs[0].token_ids


def test_failed_preprocessing_fails_that_request_only(llm, monkeypatch):
    def broken(images, kwargs):
        raise ValueError("the image processor failed on multi_modal_data['image']: broken")

    monkeypatch.setattr(llm.feature(ImageFeature).processor, "_preprocess", broken)
    outs = llm.generate([image_request(random_image(50, 40, seed=1)), "plain text"], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "broken" in outs[0].outputs[0].stop_reason
    assert len(outs[1].outputs[0].token_ids) == GREEDY.max_tokens
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == bm.num_blocks


def test_images_over_max_image_pixels_are_refused(llm):
    with pytest.raises(ValueError, match=r"is 201x200 pixels, more than max_image_pixels=40000"):
        llm.generate(image_request(random_image(201, 200)), GREEDY, use_tqdm=False)
    assert llm.is_finished() and not llm.requests
    with pytest.raises(ValueError, match="more than 1000 \\(--max-image-pixels"):
        MediaLoader(max_image_pixels=1000).load_image(data_url(random_image(40, 40)))
    assert MediaLoader(max_image_pixels=2000).load_image(data_url(random_image(40, 40))).size == (40, 40)
