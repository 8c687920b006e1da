"""
The HTTP server under the capture server (and under bench.py's baselines): uvicorn on a socket we
bind, on the running event loop, without uvicorn's signal handlers, and GuardedHttp, uvicorn's
HTTP/1.1 protocol with the limits it lacks (a header timeout and size, malformed HTTP answered in
the client's protocol's error format, a lingering close after each refusal).

    sock = bind_socket()                                   # 127.0.0.1, a free port
    server, task = await serve_app(app, sock, http=GuardedHttp)
    server.should_exit = True; await task                  # stop

This file imports only protocols.py of ours (error_body).
"""
import asyncio
import contextlib
import json
import socket
from http import HTTPStatus

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from protocols import error_body


def new_event_loop():
    """uvloop's event loop where it is installed (vLLM installs it, and its API server serves on
    it): the server's socket and protocol work costs less per request than on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def bind_socket(host="127.0.0.1", port=0):
    """A TCP socket bound to host:port (0: a free port), ready for serve_app."""
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets
    # that say so (else Nagle + delayed ACK hold each response ~40 ms)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: the process that embeds it
    (rollout, `python capture.py`) decides what SIGINT and SIGTERM do; uvicorn's
    would stop the listener and then re-raise the signal, which kills the process
    before it can stop its engines (or does nothing when SIGINT was ignored)."""

    def capture_signals(self):
        return contextlib.nullcontext()


async def serve_app(app, sock, **config):
    """Serve an ASGI app with uvicorn on a bound socket, on the running loop (`config`:
    more uvicorn.Config options). Returns (the uvicorn server, its task) once it accepts
    connections; stop it with `server.should_exit = True` and await the task."""
    server = EmbeddedServer(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=5, **config))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()  # raises why it could not start
        await asyncio.sleep(0.005)
    return server, serving


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) with the limits it lacks: each
    request's headers must arrive within header_timeout_s and stay under ~64 KiB,
    else 408 / 431 and the connection closes (slow-header clients, a connection that
    never sends a byte); malformed HTTP gets a JSON 400 instead of plain text."""
    timer, max_header_bytes = None, 64 << 10
    lingering, linger_s = None, 2.0  # after a refusal (refuse): its close, linger_s away

    def __init__(self, *args, header_timeout_s=10.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.url = header_timeout_s, b""

    def connection_made(self, transport):
        super().connection_made(transport)
        self.on_message_begin()  # the clock starts with the connection

    def on_message_begin(self):
        super().on_message_begin()
        if self.timer is None:
            self.header_bytes, self.timer = 0, self.loop.call_later(
                self.header_timeout_s, self.refuse, 408, f"The headers did not arrive within {self.header_timeout_s:g} s.")

    def on_headers_complete(self):
        self.timer = self.timer and self.timer.cancel()
        super().on_headers_complete()

    def data_received(self, data):
        if self.lingering:  # refused: what the client still sends is dropped
            return
        counted = len(data) if self.timer else 0  # with the read that completes
                                                  # them: <= 256 KiB of body counted
        super().data_received(data)
        self.header_bytes += counted
        if self.timer and self.header_bytes > self.max_header_bytes:
            self.refuse(431, f"The request headers are larger than {self.max_header_bytes} bytes.")

    def send_400_response(self, msg):
        self.refuse(400, "The request is not valid HTTP/1.1 (its framing or headers are malformed).")

    def refuse(self, status, message):
        """Answer outside the app, in the error format of the path's protocol, and close the
        connection: a lingering close. The write side ends after the answer (FIN), and what the
        client still sends is read and dropped until it closes its side, or for linger_s. A socket
        closed with the client's bytes unread resets the connection (RST): the client's next send
        fails before it reads the answer, or its read after the answer fails instead of ending;
        under load, when the event loop reads late, slow-header clients saw resets, no 408."""
        self.timer = self.timer and self.timer.cancel()
        if self.lingering is None and not self.transport.is_closing():
            body = json.dumps(error_body("anthropic" if b"/messages" in self.url else "openai", status, message))
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (status, HTTPStatus(status).phrase.encode(),
                                                                   len(body), body.encode()))
            self.transport.write_eof()  # the client's EOF then closes it (eof_received)
            self.lingering = self.loop.call_later(self.linger_s, self.transport.close)
            if self.cycle is not None:  # a request the app still answers: its client is gone
                self.cycle.disconnected = True
                self.cycle.message_event.set()
