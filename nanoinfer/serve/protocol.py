"""Request and response bodies of the OpenAI-compatible API, shaped as OpenAI's and vLLM's server
return them. Ranges are checked once, by SamplingParams (see `to_sampling_params`)."""
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured.openai import structured_outputs_for_request


_CONSTRAINING_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                        "guided_grammar", "tools", "tool_choice", "parallel_tool_calls")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- requests -----------------------------------------------------------------------------------
_STRICT = ConfigDict(strict=True)  # no silent coercion: "n": true or "2" is a 400, as with OpenAI


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The sampling fields completions and chat share (OpenAI's, plus vLLM's extras). Other fields
    are accepted and ignored, with a warning in the log naming them (as vLLM does)."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = 0  # --scheduling-policy priority: the lower runs first
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None    # token id (as a string, as OpenAI sends it) -> bias
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and legacy guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError / TypeError naming the field, as the offline API does."""
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                 if getattr(self, name) is not None}
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key[:50]!r}") \
                        from None
        fields = {name: getattr(self, name, None) for name in _CONSTRAINING_FIELDS}
        constraint = structured_outputs_for_request(fields)  # ValueError naming the field
        return SamplingParams(
            structured_outputs=constraint, logit_bias=bias, n=self.n, stop=self.stop, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, max_tokens=max_tokens, logprobs=logprobs,
            **given)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16           # OpenAI's default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and (not v or any(p in ("", []) for p in v)):
            raise ValueError("prompt must not be empty (nor contain an empty prompt)")
        return v

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, v, info: ValidationInfo):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of is not supported (other than best_of = n)")
        return v

    def prompts(self) -> list:
        """A list of prompts, each a str or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    def to_sampling_params(self) -> SamplingParams:
        sp = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the prompt's tokens get logprobs too
            sp.prompt_logprobs = self.logprobs
        return sp


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, tool_call_id... reach the template
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None                 # None: up to max_model_len (as vLLM)
    max_completion_tokens: int | None = None      # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = None       # False: tool_choice "required" makes exactly one call
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_unset=True) for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# ---- responses ----------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _now() -> int:
    return int(time.time())


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the text inside <think> ... </think>
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its "index" among the choice's calls


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """Streamed chunks are serialized with exclude_unset (as vLLM does): `usage` appears only in
    the last chunk when asked for, a delta's role only in the first."""
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nanoinfer"
    root: str
    parent: str | None = None
    max_model_len: int
    vocab_size: int | None = None  # nanoinfer's: token ids a prompt may hold are in [0, vocab_size)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter (with runtime LoRA updating allowed)."""
    model_config = _STRICT
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_int_id: int | None = None
