"""uvicorn, as the server runs it: a connection must send its request's headers within
`header_timeout` seconds of opening (or of its previous response), and then its body within
`body_timeout` seconds, so half-open and trickling connections do not pile up; idle keep-alive connections close after uvicorn's timeout_keep_alive. On shutdown, requests
get `grace_s` seconds to finish; then the engine client cuts those still running (a stream ends
with an error event and [DONE]) and uvicorn closes what is left a moment later."""
import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

CUT_MARGIN_S = 2.0  # after the cut, how long cut responses have to reach their clients


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol; a connection whose request line and headers have not all arrived
    `header_timeout` seconds after it opened (or after its last response) is closed, and so is one
    whose request body has not all arrived `body_timeout` seconds after its headers."""
    header_timeout = 10.0
    body_timeout = 60.0

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def data_received(self, data: bytes):
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not self._timed_cycle:
            self._disarm_header_timer()  # a new request's headers are in
            if cycle.more_body and getattr(self, "_body_cycle", None) is not cycle:
                self._arm_body_timer(cycle)
        if cycle is None or not _body_pending(cycle):
            self._disarm_body_timer()  # its body is in (or answered without it: the header timer is armed)

    def connection_lost(self, exc):
        self._disarm_header_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def _arm_body_timer(self, cycle):
        self._disarm_body_timer()
        self._body_cycle = cycle
        self._body_timer = self.loop.call_later(self.body_timeout, self._body_timed_out, cycle)

    def _disarm_body_timer(self):
        timer = getattr(self, "_body_timer", None)
        if timer is not None:
            timer.cancel()
            self._body_timer = None

    def _body_timed_out(self, cycle):
        self._body_timer = None
        if not self.transport.is_closing() and self.cycle is cycle and _body_pending(cycle):
            self.transport.close()  # (the route reading the body sees the client gone)

    def _arm_header_timer(self):
        self._disarm_header_timer()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self):
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timed_out(self):
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle is self._timed_cycle):
            self.transport.close()


def _body_pending(cycle) -> bool:
    return cycle.more_body and not cycle.response_complete


class Server(uvicorn.Server):
    """uvicorn.Server whose shutdown cuts the requests still running once `grace_s` is over."""

    def __init__(self, config: uvicorn.Config, engine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None):
        loop = asyncio.get_running_loop()
        cut = loop.call_later(self.grace_s, self.engine.cut_all, "the server is shutting down")
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def run(app, engine, host: str, port: int, log_level: str, grace_s: float, header_timeout: float,
        keep_alive_s: float, body_timeout: float = HeaderTimeoutH11.body_timeout):
    protocol = type("ServerH11", (HeaderTimeoutH11,), {"header_timeout": header_timeout,
                                                       "body_timeout": body_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=grace_s + CUT_MARGIN_S)
    Server(config, engine, grace_s).run()
