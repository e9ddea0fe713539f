"""ASGI middleware that refuses a request before any route sees it: a `Host` header the server
does not answer to (DNS rebinding: a web page's script reaching a server on localhost through a
name that resolves there), a missing API key (401), and a body over the size limit (413, checked
on the declared length and on the bytes as they arrive)."""
import hmac
import ipaddress
import json
import socket

from starlette.exceptions import HTTPException

_WILDCARDS = ("0.0.0.0", "::", "")


def _error(status: int, message: str, param: str | None = None) -> tuple[dict, bytes]:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 413: "RequestTooLargeError", 421: "MisdirectedRequestError"}
    body = json.dumps({"error": {"message": message, "type": kinds.get(status, "APIError"), "param": param,
                                 "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


async def _send_error(send, status: int, message: str, param: str | None = None):
    start, body = _error(status, message, param)
    await send(start)
    await send({"type": "http.response.body", "body": body})


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The bind address and localhost; for a wildcard bind, also this machine's names and any IP
    address (a literal address cannot be rebound by DNS)."""
    hosts = ["localhost", "127.0.0.1", "::1", bind_host]
    if bind_host in _WILDCARDS:
        hosts += [socket.gethostname(), socket.getfqdn(), "<ip>"]
    return sorted({h.lower() for h in hosts if h})


class HostCheck:
    """Only `allowed` Host names (case-insensitive, any port); "*" allows all, "<ip>" any IP literal."""

    def __init__(self, app, allowed: list[str]):
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    def _ok(self, host: str) -> bool:
        if "*" in self.allowed:
            return True
        if host.startswith("["):  # [v6]:port
            name = host[1:].split("]", 1)[0]
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        name = name.lower().rstrip(".")
        if name in self.allowed:
            return True
        if "<ip>" in self.allowed:
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self._ok(host):
                return await _send_error(send, 421, f"this server does not answer to Host {host[:100]!r} "
                                                    "(see --allowed-hosts)")
        return await self.app(scope, receive, send)


class BodyLimit:
    """Bodies of at most `limit` bytes; a larger one gets a 413 (OpenAI's shape) without being read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = f"the request body is larger than this server's limit of {self.limit} bytes " \
                    "(--max-request-body-bytes)"
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, 413, too_large)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # (an HTTPException: the app's handler answers it, 413)
                    raise HTTPException(413, too_large)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except HTTPException as e:  # raised while a route not behind the app's handlers read the body
            if not started:
                await _send_error(send, e.status_code, str(e.detail))


class ApiKeyCheck:
    """`Authorization: Bearer <key>` on every route but /health, /version and /metrics (as vLLM's
    --api-key); a missing or wrong key gets a 401."""
    OPEN = ("/health", "/version", "/metrics")

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                return await _send_error(send, 401, "invalid or missing API key (Authorization: Bearer ...)")
        return await self.app(scope, receive, send)
