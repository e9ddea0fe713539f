"""render_chat: the chat template rendering shared by LLM.chat and the server."""
import pytest

from nanoinfer.chat import render_chat
from nanoinfer.utils.tiny_model import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, my name is"}]
EXPECTED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, my name is<|im_end|>\n" \
           "<|im_start|>assistant\n"


def test_renders_template_and_encodes_without_adding_special_tokens(tok):
    out = render_chat(tok, CONV)
    assert out["prompt"] == EXPECTED
    assert out["prompt_token_ids"] == tok.encode(EXPECTED, add_special_tokens=False)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert out["prompt_token_ids"].count(im_start) == 3  # the template's special tokens, each one id
    no_prompt = render_chat(tok, CONV, add_generation_prompt=False)["prompt"]
    assert no_prompt == EXPECTED.removesuffix("<|im_start|>assistant\n")


def test_text_content_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "nano"}]}]
    joined = [{"role": "user", "content": "Hello,\nnano"}]
    assert render_chat(tok, parts)["prompt"] == render_chat(tok, joined)["prompt"]


def test_custom_template_tools_and_template_kwargs(tok):
    template = ("{% if tools %}TOOLS {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
                "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = render_chat(tok, CONV[1:], chat_template=template, tools=tools, chat_template_kwargs={"shout": True})
    assert out["prompt"] == "TOOLS get_weather LOUD user: Hello, my name is;"
    assert render_chat(tok, CONV[1:], chat_template=template)["prompt"] == "user: Hello, my name is;"


def test_continue_final_message(tok):
    conv = CONV + [{"role": "assistant", "content": "Nano and I"}]
    out = render_chat(tok, conv, add_generation_prompt=False, continue_final_message=True)
    assert out["prompt"] == EXPECTED + "Nano and I"  # no end-of-turn token: the model continues the message
    with pytest.raises(ValueError, match="continue_final_message"):
        render_chat(tok, conv, add_generation_prompt=True, continue_final_message=True)


def test_assistant_tool_call_turn_may_have_no_content(tok):
    template = "{% for m in messages %}{{ m['role'] }}{% if m.get('tool_calls') %}[call]{% endif %};{% endfor %}"
    conv = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                    "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    assert render_chat(tok, conv, chat_template=template, add_generation_prompt=False)["prompt"] == \
        "user;assistant[call];tool;"


@pytest.mark.parametrize("messages, error, match", [
    ([], TypeError, "non-empty list"),
    ("hello", TypeError, "non-empty list"),
    (["hello"], TypeError, r"messages\[0\] must be a dict"),
    ([{"role": None, "content": "hi"}], ValueError, r"messages\[0\]\['role'\] must be one of"),
    ([{"content": "hi"}], ValueError, r"'role'\] must be one of"),
    ([{"role": "robot", "content": "hi"}], ValueError, "'robot'"),
    ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\['content'\] must be a str"),
    ([{"role": "user"}], TypeError, r"messages\[0\]\['content'\] is missing"),
    ([{"role": "user", "content": None}], TypeError, "missing or None"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError,
     "type 'image_url': image parts need a vision-language model"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], TypeError, r"\['text'\] must be a str"),
    ([{"role": "user", "content": ["hi"]}], TypeError, "content part"),
])
def test_bad_messages(tok, messages, error, match):
    with pytest.raises(error, match=match):
        render_chat(tok, messages)


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "messages", "chat_template", "tools",
                                 "return_dict", "continue_final_message"])
def test_reserved_template_kwargs_are_a_clear_error(tok, key):
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set \\['{key}'\\]"):
        render_chat(tok, CONV, chat_template_kwargs={key: True})


def test_bad_template_kwargs_and_tools(tok):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        render_chat(tok, CONV, chat_template_kwargs=["tokenize"])
    with pytest.raises(TypeError, match="tools must be a list of dicts"):
        render_chat(tok, CONV, tools="get_weather")
    with pytest.raises(TypeError, match="chat_template must be a str"):
        render_chat(tok, CONV, chat_template=3)


@pytest.mark.parametrize("template, match", [
    ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ messages[0]['content'].nope.deeper }}", "UndefinedError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),  # runtime errors of the template are the request's too
    ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
])
def test_template_errors_are_value_errors(tok, template, match):
    with pytest.raises(ValueError, match=f"the chat template failed: .*{match}"):
        render_chat(tok, CONV, chat_template=template)


def test_rendered_output_is_bounded(tok):
    template = "{{ 'a' * 5000 }}"
    assert len(render_chat(tok, CONV, chat_template=template, max_output_chars=5000)["prompt"]) == 5000
    with pytest.raises(ValueError, match="more than the limit of 4999"):
        render_chat(tok, CONV, chat_template=template, max_output_chars=4999)


def test_no_chat_template(tok):
    bare = train_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(bare, CONV)
    assert render_chat(bare, CONV, chat_template="{{ messages[-1]['content'] }}")["prompt"] == "Hello, my name is"
