"""What the routes share about a request once it is submitted: the model it names, its final
outputs (aborted if the client leaves first), and the error a failed sample makes of it."""
import asyncio
from collections.abc import Container

from fastapi import Request
from fastapi.responses import Response

from nanoinfer.outputs import NON_FINITE_REASON, RequestOutput
from nanoinfer.process.engine_client import FINAL_OUTPUTS, EngineClient, Submission
from nanoinfer.serve.errors import APIError

NON_FINITE_MESSAGE = ("no token could be sampled for this request: the model produced non-finite logits (NaN or inf), "
                      "or its allowed_token_ids / bad_words left its grammar no token; see the server log")


def check_model(model: str | None, model_names: Container[str]):
    if model is not None and model not in model_names:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


async def collect_outputs(engine: EngineClient, sub: Submission, request: Request) -> list[RequestOutput] | Response:
    """Every prompt's final output (a RequestOutput, or an embedding's PoolingRequestOutput); if the
    client disconnects first, abort and answer nobody."""
    outputs: list[RequestOutput | None] = [None] * len(sub.prompts)

    async def collect():
        async for i, item in sub.results():
            if isinstance(item, FINAL_OUTPUTS):
                outputs[i] = item

    done = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(disconnected(request))
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
    failure = failure_of(c for out in outputs if isinstance(out, RequestOutput) for c in out.outputs)
    if failure is not None:
        raise APIError(*failure)
    return outputs


def failure_of(completions) -> tuple[int, str] | None:
    """The error of a request whose sample finished with "error": a 500 if no token could be sampled
    for it, else a 400 with the reason its intake failed (a grammar that does not compile, an image
    that does not decode)."""
    for c in completions:
        if getattr(c, "finish_reason", None) == "error":
            reason = getattr(c, "stop_reason", None)
            if isinstance(reason, str) and reason != NON_FINITE_REASON:
                return 400, reason
            return 500, NON_FINITE_MESSAGE
    return None


async def disconnected(request: Request):
    """Returns when the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
