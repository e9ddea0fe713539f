"""The OpenAI-compatible HTTP API (FastAPI routes) over the engine process (an EngineClient).

Every error has OpenAI's shape (errors.py). A client that disconnects has its requests aborted,
streaming or not.
"""
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from nanoinfer.outputs import RequestOutput
from nanoinfer.serve import convert
from nanoinfer.serve.engine_client import EngineClient, EngineDeadError, Submission
from nanoinfer.serve.errors import APIError, add_error_handlers, error_body, error_response
from nanoinfer.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from nanoinfer.utils.chat import render_chat


def build_app(engine: EngineClient, served_model_name: str) -> FastAPI:
    """The app; the engine process starts serving with the app's lifespan and stops after it."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:  # after uvicorn's graceful shutdown: the in-flight requests have ended
            engine.stop()

    app = FastAPI(title="nanoinfer", lifespan=lifespan)
    app.state.engine = engine
    add_error_handlers(app)
    add_status_routes(app, engine, served_model_name)
    add_generation_routes(app, engine, served_model_name)
    return app


def add_status_routes(app: FastAPI, engine: EngineClient, served_model_name: str):
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
        return ModelList(data=[ModelCard(id=served_model_name, root=engine.model, max_model_len=engine.max_model_len)])


def add_generation_routes(app: FastAPI, engine: EngineClient, served_model_name: str):
    """Chat prompts are rendered here, with the engine's tokenizer (a copy it sent at start)."""
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, served_model_name)
        sub = await _submit(engine, body.prompts(), body, body.stream)
        if body.stream:
            return _event_stream(engine, convert.completion_chunks(sub, served_model_name, body.include_usage), sub)
        outputs = await _outputs(engine, sub, request)
        return outputs if isinstance(outputs, Response) else convert.completion_response(outputs, served_model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, served_model_name)
        try:
            prompt = render_chat(engine.tokenizer, body.message_dicts(), chat_template=body.chat_template,
                                 add_generation_prompt=body.add_generation_prompt,
                                 chat_template_kwargs=body.chat_template_kwargs, tools=body.tools,
                                 continue_final_message=body.continue_final_message)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "messages") from e
        top = (body.top_logprobs or 0) if body.logprobs else None
        sub = await _submit(engine, [prompt], body, body.stream)
        if body.stream:
            return _event_stream(engine, convert.chat_chunks(sub, served_model_name, body.include_usage, top), sub)
        outputs = await _outputs(engine, sub, request)
        return outputs if isinstance(outputs, Response) else convert.chat_response(outputs[0], served_model_name, top)


def _check_model(model: str | None, served_model_name: str):
    if model is not None and model != served_model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


async def _submit(engine: EngineClient, prompts: list, body, stream: bool) -> Submission:
    try:
        params = body.to_sampling_params()
        return await engine.submit(prompts, params, stream)
    except (ValueError, TypeError) as e:  # SamplingParams' and add_request's: they name the field
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name in type(body).model_fields else None) from e


async def _outputs(engine: EngineClient, sub: Submission, request: Request) -> list[RequestOutput] | Response:
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


def _event_stream(engine: EngineClient, chunks: AsyncIterator[BaseModel], sub: Submission) -> EventSourceResponse:
    """Server-sent events: one `data: {chunk}` per chunk, then `data: [DONE]`. Closing the stream
    early (the client left) aborts the requests."""
    async def events():
        complete = False
        try:
            async for chunk in chunks:
                yield format_sse_event(data_str=chunk.model_dump_json(exclude_unset=True))
            complete = True
        except EngineDeadError as e:
            complete = True
            yield format_sse_event(data_str=error_body(503, str(e)).model_dump_json())
        finally:
            if not complete:  # cancelled: the client left
                engine.abort(sub)
        yield format_sse_event(data_str="[DONE]")

    return EventSourceResponse(events())


async def _disconnected(request: Request):
    """Returns when the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
