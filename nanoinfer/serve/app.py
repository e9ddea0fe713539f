"""The OpenAI-compatible HTTP API (FastAPI routes) over the engine process (an EngineClient).

Every error has OpenAI's shape (errors.py). A client that disconnects has its requests aborted,
streaming or not.
"""
import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Container
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from nanoinfer.serve import convert
from nanoinfer.serve.chat_renderer import ChatRenderer, RenderRefused
from nanoinfer.serve.chat_reply import ReplyFormat
from nanoinfer.serve.embeddings import add_embedding_routes
from nanoinfer.process.engine_client import EngineClient, EngineDeadError, ShutdownCut, Submission
from nanoinfer.serve.errors import APIError, add_error_handlers, error_body, error_response
from nanoinfer.serve.http_guards import ApiKeyCheck, BodyLimit, HostCheck
from nanoinfer.serve.limits import ServerLimits, prompt_chars_limit
from nanoinfer import __version__
from nanoinfer.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from nanoinfer.serve.metrics import ServerMetrics
from nanoinfer.serve.lora_modules import ServedModels, check_adapter_files
from nanoinfer.serve.request_outputs import check_model, collect_outputs, failure_of
from nanoinfer.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      LoadLoRAAdapterRequest, ModelCard, ModelList, TokenizeRequest,
                                      UnloadLoRAAdapterRequest)

logger = logging.getLogger("nanoinfer.serve")


def build_app(engine: EngineClient, served_model_name: str, *, limits: ServerLimits = ServerLimits(),
              renderer: ChatRenderer | None = None, allowed_hosts: list[str] | None = None,
              enable_docs: bool = False, model_aliases: tuple[str, ...] = (), api_key: str | None = None,
              reasoning_parser: str | None = None, tool_call_parser: str = "hermes",
              lora_modules: list = (), allow_lora_updating: bool = False) -> FastAPI:
    """The app; the engine process starts serving with the app's lifespan and stops after it.
    allowed_hosts: the Host names answered (None: any); model_aliases: other names a request's
    `model` may use (e.g. the path given on the command line); /v1/models lists the served name
    and the adapters. lora_modules: LoRARequests a request selects by naming them in `model`;
    allow_lora_updating: serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    renderer = renderer or ChatRenderer(engine.tokenizer,
                                        max_prompt_chars=prompt_chars_limit(limits, engine.tokenizer,
                                                                            engine.max_model_len))
    engine.metrics = ServerMetrics(served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # what start-up made (libraries, the tokenizer, the routes) out of the cycle collector's
        # full scans, which would stall every stream on the event loop (as the engine does)
        gc.freeze()
        try:
            yield
        finally:  # after uvicorn's graceful shutdown: the in-flight requests have ended
            engine.stop()
            renderer.close()
            gc.unfreeze()

    docs = {} if enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="nanoinfer", lifespan=lifespan, **docs)
    app.state.engine = engine
    add_error_handlers(app)
    model_names = ServedModels((served_model_name, *model_aliases), list(lora_modules))
    adapters = model_names.adapters  # (live: runtime updating changes it)
    add_status_routes(app, engine, served_model_name, model_names, renderer, adapters)
    add_generation_routes(app, engine, served_model_name, limits, renderer, model_names, reasoning_parser is not None,
                          tool_call_parser, adapters)
    if allow_lora_updating:
        add_lora_updating_routes(app, model_names)
    if engine.summary.get("runner") == "pooling":
        add_embedding_routes(app, engine, served_model_name, model_names, renderer, limits)
    app.add_middleware(BodyLimit, limit=limits.max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, key=api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)  # (added last: runs first)
    return app


def add_status_routes(app: FastAPI, engine: EngineClient, served_model_name: str, model_names: Container[str],
                      renderer: ChatRenderer, adapters: dict | None = None):
    @app.get("/health")
    async def health():
        """200 while the engine (every tensor-parallel rank of it) runs, else 503."""
        if not engine.alive:
            return error_response(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        """Requests in the engine now; since start: requests finished or aborted, and their prompt
        and generated tokens; with data-parallel replicas, `replicas`: the same per replica."""
        stats = {"requests_running": engine.num_requests, "requests_finished": engine.num_finished,
                 "prompt_tokens_total": engine.prompt_tokens, "generation_tokens_total": engine.generation_tokens}
        if hasattr(engine, "replica_stats"):
            stats["replicas"] = engine.replica_stats()
        return stats

    adapters = adapters or {}

    def card(name: str | None = None) -> ModelCard:
        lora = adapters.get(name)
        if lora is not None:  # (vLLM's: an adapter's root is its path, its parent the base model)
            return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=served_model_name,
                             max_model_len=engine.max_model_len, vocab_size=engine.summary.get("vocab_size"))
        return ModelCard(id=served_model_name, root=served_model_name, max_model_len=engine.max_model_len,
                         vocab_size=engine.summary.get("vocab_size"))

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(), *(card(name) for name in adapters)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id not in model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return card(model_id)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        """Prometheus' text format (serve/metrics.py)."""
        return Response(engine.metrics.render() if engine.metrics else b"", media_type=METRICS_CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the prompt's token ids (or the chat messages', rendered), their count, max_model_len."""
        check_model(body.model, model_names)
        try:
            if body.messages is not None:
                ids = (await renderer.render([m.model_dump(exclude_unset=True) for m in body.messages],
                                             add_generation_prompt=body.add_generation_prompt))["prompt_token_ids"]
            else:
                ids = await renderer.encode(body.prompt, body.add_special_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "messages" if body.messages is not None else "prompt") from e
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model, model_names)
        vocab = len(engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": await renderer.decode(body.tokens)}


def add_generation_routes(app: FastAPI, engine: EngineClient, served_model_name: str, limits: ServerLimits,
                          renderer: ChatRenderer, model_names: Container[str], reasoning: bool = False,
                          tool_call_parser: str = "hermes", adapters: dict | None = None):
    """Prompts are rendered and tokenized here, off the event loop, with the engine's tokenizer (a
    copy it sent at start); the engine process gets token ids, and the adapter `model` names."""
    adapters = adapters or {}
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_request(body, model_names, limits)
        if body.echo and body.stream:
            raise APIError(400, "echo is not supported with stream", "echo")
        try:
            prompts = await renderer.tokenize(body.prompts())
        except (ValueError, TypeError) as e:  # e.g. a lone surrogate
            raise APIError(400, str(e), "prompt") from e
        sub = await _submit(engine, prompts, body, body.stream, adapters.get(body.model))
        name = body.model if body.model in adapters else served_model_name  # (vLLM answers with the adapter's)
        if body.stream:
            return _event_stream(engine, convert.completion_chunks(sub, name, body.include_usage), sub)
        outputs = await collect_outputs(engine, sub, request)
        return outputs if isinstance(outputs, Response) else \
            await _json_reply(lambda: convert.completion_response(outputs, name, body.echo, engine.tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_request(body, model_names, limits)
        try:
            prompt = await renderer.render(body.message_dicts(), chat_template=body.chat_template,
                                           add_generation_prompt=body.add_generation_prompt,
                                           chat_template_kwargs=body.chat_template_kwargs, tools=body.tools,
                                           continue_final_message=body.continue_final_message)
        except RenderRefused as e:
            raise APIError(400, str(e), "chat_template") from e
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "messages") from e
        top = (body.top_logprobs or 0) if body.logprobs else None
        reply = ReplyFormat.of(body, reasoning, tool_call_parser)
        sub = await _submit(engine, [prompt], body, body.stream, adapters.get(body.model))
        name = body.model if body.model in adapters else served_model_name
        if body.stream:
            return _event_stream(engine, convert.chat_chunks(sub, name, body.include_usage, top, reply), sub)
        outputs = await collect_outputs(engine, sub, request)
        return outputs if isinstance(outputs, Response) else \
            await _json_reply(lambda: convert.chat_response(outputs[0], name, top, reply))


async def _json_reply(build) -> Response:
    """A non-streamed reply, built and serialised in a worker thread (as FastAPI would serialise the
    model): a large one (many choices, logprobs, tool-call parsing) would otherwise hold the event
    loop, and every other request's stream, while it is made."""
    def run() -> bytes:
        return build().model_dump_json(by_alias=True).encode()
    return Response(await asyncio.to_thread(run), media_type="application/json")


def add_lora_updating_routes(app: FastAPI, models: ServedModels):
    """vLLM's runtime LoRA updating: add or remove an adapter name while serving."""
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        try:  # the files are read in a worker thread; the name is taken on the event loop
            models.check_name(body.lora_name)
            await asyncio.to_thread(check_adapter_files, body.lora_path)
            models.add(body.lora_name, body.lora_path)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "lora_name" if "already" in str(e) or "lora_name" in str(e)
                           else "lora_path") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        try:
            models.unload(body.lora_name)
        except KeyError as e:
            raise APIError(404, e.args[0], "lora_name") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _check_request(body, model_names: Container[str], limits: ServerLimits):
    check_model(body.model, model_names)
    if body.model_extra:
        logger.warning("fields the server does not use were ignored: %s", ", ".join(sorted(body.model_extra))[:500])
    try:
        limits.check(body)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from e


async def _submit(engine: EngineClient, prompts: list, body, stream: bool, lora_request=None) -> Submission:
    try:
        params = await asyncio.to_thread(body.to_sampling_params)  # (parses a structured-outputs spec)
        _check_min_tokens(params, prompts, engine.max_model_len)
        return await engine.submit(prompts, params, stream, priority=body.priority, lora_request=lora_request)
    except (ValueError, TypeError) as e:  # SamplingParams' and add_request's: they name the field
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name in type(body).model_fields else None) from e


def _check_min_tokens(params, prompts: list, max_model_len: int):
    """Without max_tokens, a request may generate up to max_model_len: min_tokens past what is left
    after its longest prompt is refused (as vLLM, which fills in that max_tokens first)."""
    if params.max_tokens is not None or not params.min_tokens:
        return
    lengths = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts
               if isinstance(p, list) or isinstance(p, dict) and "prompt_token_ids" in p]
    room = max_model_len - max(lengths, default=0)
    if params.min_tokens > room:
        raise ValueError(f"min_tokens must be at most max_tokens, which defaults to max_model_len - the prompt's "
                         f"tokens = {room}, got {params.min_tokens}")


def _event_stream(engine: EngineClient, chunks: AsyncIterator[BaseModel], sub: Submission) -> EventSourceResponse:
    """Server-sent events: one `data: {chunk}` per chunk, then `data: [DONE]`. Closing the stream
    early (the client left) aborts the requests."""
    async def events():
        complete = False
        try:
            async for chunk in chunks:
                failure = failure_of(chunk.choices)
                if failure is not None:
                    complete = True  # (the request's other samples are aborted below)
                    yield format_sse_event(data_str=error_body(*failure).model_dump_json())
                    break
                yield format_sse_event(data_str=chunk.model_dump_json(exclude_unset=True))
            else:
                complete = True
        except (EngineDeadError, ShutdownCut) as e:
            complete = True
            yield format_sse_event(data_str=error_body(503, str(e)).model_dump_json())
        finally:
            if not complete:  # cancelled: the client left
                engine.abort(sub)
        engine.abort(sub)  # (a no-op once every prompt is done)
        yield format_sse_event(data_str="[DONE]")

    return EventSourceResponse(events())
