"""Chat prompts rendered, and text prompts tokenized, off the HTTP event loop, each bounded in size
(and renders in time).

Text longer than any prompt that fits max_model_len (limits.prompt_chars_limit) is refused before
it is tokenized. The work runs in tokenizer_lanes' worker threads, shared fairly between requests.
The checkpoint's own template is the operator's choice: it renders in a worker thread, and a
render past the time limit fails its request (the thread ends by itself; its work grows only with
the request, which the body and prompt limits bound). A template sent in a request
(`chat_template`) is untrusted code: refused unless the server runs with
--trust-request-chat-template, and then rendered in a sandbox process (template_sandbox.py), killed
at the time limit, so that a template bomb costs its request alone.
"""
import asyncio

from nanoinfer.chat import render_chat
from nanoinfer.engine.detokenizer import encode as encode_prompt  # the engine's own encoding of a text prompt
from nanoinfer.serve.template_sandbox import TemplateSandbox
from nanoinfer.serve.tokenizer_lanes import TokenizerLanes


class RenderRefused(ValueError):
    """A request's template was refused (the server does not trust request templates)."""


class ChatRenderer:
    def __init__(self, tokenizer, trust_request_templates: bool = False, timeout_s: float = 5.0,
                 max_output_chars: int = 1 << 22, threads: int = 4, media=None, max_prompt_chars: int | None = None,
                 sandbox_renders: int = 4):
        """media: the multimodal.media.MediaLoader that reads image content parts (None: refused);
        max_prompt_chars: longer text prompts (and rendered chats) are refused before tokenizing
        (None: no limit); sandbox_renders: request templates rendering at once."""
        self.tokenizer = tokenizer
        self.media = media
        self.timeout_s = timeout_s
        self.max_prompt_chars = max_prompt_chars
        # a rendered chat longer than max_prompt_chars is refused before it is tokenized
        self.max_output_chars = max_output_chars if max_prompt_chars is None else min(max_output_chars,
                                                                                      max_prompt_chars)
        self.trust_request_templates = trust_request_templates
        self._lanes = TokenizerLanes(threads)
        self._sandbox = TemplateSandbox(tokenizer, self.max_output_chars, media, sandbox_renders) \
            if trust_request_templates else None

    async def render(self, messages, chat_template: str | None = None, **options) -> dict:
        """render_chat's {"prompt", "prompt_token_ids"}; ValueError / TypeError for bad input, a
        template error, a render past the limits, or a refused request template."""
        if chat_template is not None:
            if self._sandbox is None:
                raise RenderRefused("a chat_template in the request is refused: the server runs the model's own "
                                    "template unless it was started with --trust-request-chat-template")
            return await self._sandbox.render(dict(options, messages=messages, chat_template=chat_template),
                                              self.timeout_s)
        work = self._lanes.submit(_chars(messages), render_chat, self.tokenizer, messages,
                                  max_output_chars=self.max_output_chars, media=self.media, **options)
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"the chat template did not finish rendering within {self.timeout_s:g} s") from None

    async def tokenize(self, prompts: list) -> list:
        """Text prompts as {"prompt", "prompt_token_ids"} (token-id prompts as they are), encoded in
        the worker threads: a long prompt's tokenization holds up neither the event loop, nor the
        engine's steps, nor other requests' prompts."""
        if not any(isinstance(p, str) for p in prompts):
            return prompts
        for p in prompts:
            if isinstance(p, str):
                self.check_chars(p)

        def encode(p):
            return {"prompt": p, "prompt_token_ids": encode_prompt(self.tokenizer, p)} if isinstance(p, str) else p
        return await self._lanes.map(encode, prompts, [len(p) if isinstance(p, str) else 1 for p in prompts])

    def check_chars(self, text: str, field: str = "prompt"):
        """ValueError if `text` is longer than any prompt that could fit (it is not tokenized then)."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ValueError(f"{field} has {len(text)} characters, more than this server's limit of "
                             f"{self.max_prompt_chars} (--max-prompt-chars): more tokens than max_model_len")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_chars(text)
        return await self._lanes.submit(len(text), self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._lanes.submit(len(token_ids), self.tokenizer.decode, token_ids)

    def close(self):
        self._lanes.shutdown()
        if self._sandbox is not None:
            self._sandbox.close()


def _chars(messages) -> int:
    """About the characters a conversation's render writes (its texts'), to pick its lane."""
    total = 0
    for m in messages if isinstance(messages, (list, tuple)) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, (list, tuple)):
            total += sum(len(part.get("text") or "") for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total
