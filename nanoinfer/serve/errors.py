"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every failure the
HTTP API reports: invalid parameters (pydantic's or nanoinfer's ValueError / TypeError) and malformed
JSON are 400, an unknown model 404, a stopped engine 503, anything else 500."""
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanoinfer.process.engine_client import EngineDeadError, ShutdownCut
from nanoinfer.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("nanoinfer.serve")

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestTooLargeError", 421: "MisdirectedRequestError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=_utf8(message), type=_ERROR_TYPES.get(status, "APIError"),
                                         param=None if param is None else _utf8(param), code=status))


def _utf8(text: str) -> str:
    """`text` with what UTF-8 cannot write (a lone surrogate a request sent, quoted back) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


def add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return _validation_response(e.errors())

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return error_response(503, str(e))

    @app.exception_handler(ShutdownCut)
    async def _shutdown_cut(_, e: ShutdownCut):
        return error_response(503, str(e))

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception):  # a bug: the log keeps the traceback, the client gets its kind
        logger.error("internal error", exc_info=e)
        return error_response(500, f"internal server error ({type(e).__name__}); see the server log")


def _validation_response(errors: list[dict]) -> JSONResponse:
    """pydantic's errors as one 400: malformed JSON, or every invalid field by its location (the
    first one is the error's param)."""
    if any(err.get("type") == "json_invalid" for err in errors):
        reason = errors[0].get("ctx", {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON: {reason}")
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return error_response(400, "; ".join(parts), param)
