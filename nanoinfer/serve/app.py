"""The OpenAI-compatible HTTP API (FastAPI routes) over the engine process (an EngineClient).

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`: invalid parameters
(pydantic's or nanoinfer's ValueError / TypeError) and malformed JSON are 400, an unknown model 404.
A client that disconnects has its requests aborted, streaming or not.
"""
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from nanoinfer.outputs import RequestOutput
from nanoinfer.serve import convert
from nanoinfer.serve.engine_client import EngineClient, EngineDeadError, Submission
from nanoinfer.serve.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse,
                                      ModelCard, ModelList)
from nanoinfer.utils.chat import render_chat

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "APIError"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def build_app(engine: EngineClient, served_model_name: str) -> FastAPI:
    """Chat prompts are rendered here, with the engine's tokenizer (a copy it sent at start)."""
    tokenizer, max_model_len = engine.tokenizer, engine.max_model_len

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:  # after uvicorn's graceful shutdown: the in-flight requests have ended
            engine.stop()

    app = FastAPI(title="nanoinfer", lifespan=lifespan)
    app.state.engine = engine

    # ---- errors ---------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            reason = errors[0].get("ctx", {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON: {reason}")
        parts, param = [], None
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return error_response(400, "; ".join(parts), param)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return error_response(503, str(e))

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception):
        return error_response(500, f"{type(e).__name__}: {e}")

    # ---- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """200 while the engine runs, else 503."""
        if not engine.alive:
            return error_response(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        """Requests in the engine now; since start: requests finished or aborted, and their prompt
        and generated tokens."""
        return {"requests_running": engine.num_requests, "requests_finished": engine.num_finished,
                "prompt_tokens_total": engine.prompt_tokens, "generation_tokens_total": engine.generation_tokens}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, root=engine.model, max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        sub = await _submit(body.prompts(), body, body.stream)
        if body.stream:
            return _stream(convert.completion_chunks(sub, served_model_name, body.include_usage), sub)
        outputs = await _outputs(sub, request)
        return outputs if isinstance(outputs, Response) else convert.completion_response(outputs, served_model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model)
        try:
            prompt = render_chat(tokenizer, body.message_dicts(), chat_template=body.chat_template,
                                 add_generation_prompt=body.add_generation_prompt,
                                 chat_template_kwargs=body.chat_template_kwargs, tools=body.tools,
                                 continue_final_message=body.continue_final_message)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "messages") from e
        top = (body.top_logprobs or 0) if body.logprobs else None
        sub = await _submit([prompt], body, body.stream)
        if body.stream:
            return _stream(convert.chat_chunks(sub, served_model_name, body.include_usage, top), sub)
        outputs = await _outputs(sub, request)
        return outputs if isinstance(outputs, Response) else convert.chat_response(outputs[0], served_model_name, top)

    # ---- helpers --------------------------------------------------------------------------------
    def _check_model(model: str | None):
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def _submit(prompts: list, body, stream: bool) -> Submission:
        try:
            params = body.to_sampling_params()
            return await engine.submit(prompts, params, stream)
        except (ValueError, TypeError) as e:  # SamplingParams' and add_request's: they name the field
            name = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), name if name in type(body).model_fields else None) from e

    async def _outputs(sub: Submission, request: Request) -> list[RequestOutput] | Response:
        """Every prompt's final output; if the client disconnects first, abort and answer nobody."""
        outputs: list[RequestOutput | None] = [None] * len(sub.prompts)

        async def collect():
            async for i, item in sub.results():
                if isinstance(item, RequestOutput):
                    outputs[i] = item

        done = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([done, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not done.done():
                done.cancel()
                engine.abort(sub)
        if not done.done() or done.cancelled():
            return Response(status_code=499)  # the client closed the request: nobody reads this
        done.result()  # the engine's error, if any
        return outputs

    def _stream(chunks: AsyncIterator[BaseModel], sub: Submission) -> EventSourceResponse:
        """Server-sent events: one `data: {chunk}` per chunk, then `data: [DONE]`. Closing the
        stream early (the client left) aborts the requests."""
        async def events():
            complete = False
            try:
                async for chunk in chunks:
                    yield format_sse_event(data_str=chunk.model_dump_json(exclude_unset=True))
                complete = True
            except EngineDeadError as e:
                complete = True
                body = ErrorResponse(error=ErrorInfo(message=str(e), type=_ERROR_TYPES[503], code=503))
                yield format_sse_event(data_str=body.model_dump_json())
            finally:
                if not complete:  # cancelled: the client left
                    engine.abort(sub)
            yield format_sse_event(data_str="[DONE]")

        return EventSourceResponse(events())

    return app


async def _disconnected(request: Request):
    """Returns when the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

