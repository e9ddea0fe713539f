"""/v1/embeddings (OpenAI's shape), served when the engine runs a pooling model (--runner pooling):
`input` a string, strings, token ids or lists of token ids; `encoding_format` float or base64
(little-endian float32, as OpenAI's); `dimensions` (Matryoshka); vLLM's `priority`."""
import base64
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, field_validator

from nanoinfer.pooling import PoolingParams
from nanoinfer.serve.request_outputs import check_model, collect_outputs
from nanoinfer.serve.errors import APIError
from nanoinfer.serve.limits import ServerLimits


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int = 0  # vLLM's extension (--scheduling-policy priority)
    normalize: bool | None = None  # vLLM's extension

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if v in ("", []) or (isinstance(v, list) and any(p in ("", []) for p in v)):
            raise ValueError("input must not be empty (nor contain an empty input)")
        return v

    def prompts(self) -> list:
        x = self.input
        return [x] if isinstance(x, str) or isinstance(x[0], int) else list(x)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _encode(vector, encoding_format: str) -> list[float] | str:
    """A pooled vector (numpy, as the engine process sends it) as OpenAI's floats or base64."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return np.asarray(vector).tolist()


def add_embedding_routes(app: FastAPI, engine, served_model_name: str, model_names: tuple[str, ...], renderer,
                         limits: ServerLimits = ServerLimits()):
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        check_model(body.model, model_names)
        try:
            limits.check_sequences(len(body.prompts()), field="input")
            params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
            prompts = await renderer.tokenize(body.prompts())
            sub = await engine.submit(prompts, params, False, priority=body.priority,
                                      lora_request=model_names.adapter(body.model))  # (None: the base)
        except (ValueError, TypeError) as e:  # they name the field
            name = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), name if name in EmbeddingRequest.model_fields else "input") from e
        outputs = await collect_outputs(engine, sub, request)
        if isinstance(outputs, Response):
            return outputs
        data = [EmbeddingData(index=i, embedding=_encode(out.outputs.data, body.encoding_format))
                for i, out in enumerate(outputs)]
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return EmbeddingResponse(data=data, model=served_model_name,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
