"""Render a chat conversation to a prompt through the tokenizer's chat template (shared by
`LLM.chat` and the OpenAI-compatible server)."""
from collections.abc import Mapping

from nanoinfer.multimodal import media as media_limits  # (read at call time: the limit is a module setting)
from nanoinfer.multimodal.chat_parts import image_of_part, join_content, template_takes_parts


ROLES = ("system", "user", "assistant", "tool", "developer")
# Arguments render_chat passes to apply_chat_template itself, or that would change what it returns,
# plus the names the template renderer sets: chat_template_kwargs may not override them.
_RESERVED_KWARGS = frozenset({
    "conversation", "conversations", "messages", "chat_template", "tools", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def render_chat(tokenizer, messages, chat_template: str | None = None, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                continue_final_message: bool = False,
                max_output_chars: int | None = None, media=None) -> dict:
    """One conversation (a list of {"role", "content"} messages; content a str or a list of OpenAI
    text parts) -> {"prompt": the rendered text, "prompt_token_ids": its token ids}. The ids are
    encoded without adding special tokens: the template writes them. `tools` (JSON schemas) and
    `chat_template_kwargs` (extra template variables) reach the template. Bad input raises
    ValueError / TypeError naming the message and field; a template error (a Jinja error or a runtime
    one: division by zero, a range too large) raises ValueError, as does a render that writes more
    than `max_output_chars`. media: a multimodal.media.MediaLoader for image content parts (their
    images are returned as "multi_modal_data"); None refuses them."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass chat_template=... (a Jinja template) "
                         "or use plain prompts")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a str (a Jinja template), got {type(chat_template).__name__}")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.200}")
    images, parts = [], {}  # parts: message index -> its content as OpenAI parts, for messages with images
    pixels = [0]  # the images' pixels so far: all of a conversation's images are bounded together
    conversation = [_message(m, i, media, images, parts, pixels) for i, m in enumerate(messages)]
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)):
        raise TypeError(f"tools must be a list of dicts (JSON schemas), got {tools!r:.200}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set: "
                         "continue the last message, or start a new assistant message")
    kwargs = _template_kwargs(chat_template_kwargs)
    if parts:
        if template_takes_parts(tokenizer, chat_template):  # it writes the image placeholders itself
            for i, content in parts.items():
                conversation[i]["content"] = content
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tools=None if tools is None else [dict(t) for t in tools],
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **kwargs)
    except Exception as e:  # the template's own error, whatever it is: the request's fault
        raise ValueError(f"the chat template failed: {type(e).__name__}: {str(e)[:500]}") from e
    if max_output_chars is not None and len(text) > max_output_chars:
        raise ValueError(f"the chat template wrote {len(text)} characters, more than the limit of {max_output_chars}")
    prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def _message(message, i: int, media=None, images: list | None = None, parts: dict | None = None,
             pixels: list | None = None) -> dict:
    """A validated copy of message i, its content parts joined into one string. Its images join
    `images`, and its content as OpenAI parts (images as {"type": "image"}) goes to parts[i]."""
    if not isinstance(message, Mapping):
        raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"messages[{i}]['role'] must be one of {', '.join(ROLES)}; got {role!r}")
    out = dict(message)
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        texts, found, ordered = [], [], []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in ("image_url", "image_pil"):
                pixels = [0] if pixels is None else pixels
                left = media_limits.MAX_REQUEST_PIXELS - pixels[0]
                image = image_of_part(part, f"messages[{i}]['content'][{j}]", media, left)
                pixels[0] += image.width * image.height
                if pixels[0] > media_limits.MAX_REQUEST_PIXELS:  # (an image_pil part, already decoded)
                    raise ValueError(f"messages[{i}]['content'][{j}]: the conversation's images hold more than "
                                     f"{media_limits.MAX_REQUEST_PIXELS} pixels in all")
                found.append(image)
                ordered.append({"type": "image"})
            else:
                texts.append(_text_part(part, i, j))
                ordered.append({"type": "text", "text": texts[-1]})
        if found:
            images.extend(found)
            parts[i] = ordered
            out["content"] = join_content(texts, len(found))
        else:
            out["content"] = "\n".join(texts)  # as vLLM joins them
    elif content is None:
        if not (role == "assistant" and message.get("tool_calls")):  # only a tool-calling turn may have none
            raise TypeError(f"messages[{i}]['content'] is missing or None; it must be a str or a list of text parts")
    elif not isinstance(content, str):
        raise TypeError(f"messages[{i}]['content'] must be a str or a list of text parts, "
                        f"got {type(content).__name__}")
    return out


def _text_part(part, i: int, j: int) -> str:
    where = f"messages[{i}]['content'][{j}]"
    if not isinstance(part, Mapping) or "type" not in part:
        raise TypeError(f"{where} must be a content part {{'type': 'text', 'text': ...}}, got {part!r:.100}")
    if part["type"] != "text":
        raise ValueError(f"{where} has type {part['type']!r}; 'text', 'image_url' and 'image_pil' content parts "
                         "are supported")
    if not isinstance(part.get("text"), str):
        raise TypeError(f"{where}['text'] must be a str, got {type(part.get('text')).__name__}")
    return part["text"]


def _template_kwargs(chat_template_kwargs) -> dict:
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise TypeError(f"chat_template_kwargs must be a dict with str keys, got {chat_template_kwargs!r:.200}")
    reserved = sorted(set(chat_template_kwargs) & _RESERVED_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: render_chat sets them itself "
                         "(pass tools / add_generation_prompt / continue_final_message as arguments)")
    return dict(chat_template_kwargs)
