"""HTTP requests through Django's synchronous handler, on a fixed pool of threads.

Every Hangar view is synchronous. Django's ASGI handler runs each request on a thread
it starts for that request, and crosses between that thread and the event loop three
times on the way through the middleware and the view; measured in-process on a job
submit, that cost 3.8 ms of CPU where the same request through the WSGI handler cost
2.4 ms. Here uvicorn keeps the sockets (and Channels the websockets), and each HTTP
request crosses to a pool thread once: the whole Django request, middleware, view and
`request_finished` (which gives the database connection back) run on that thread.

A streaming response (a log download, a static file) is read and sent chunk by chunk on
a thread of its own, so a long download does not hold one of the pool's threads; it
waits for each send and stops when the client goes away.
"""

import asyncio
import concurrent.futures
import sys
import threading
from collections import defaultdict
from tempfile import SpooledTemporaryFile

from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections

from portal import bodylimits

STREAM_CHUNK = 64 * 1024  # a streaming response's pieces are sent at least this big


class SyncHttpApp:
    """An ASGI app for `http` scopes that runs a WSGI application on `threads` threads."""

    def __init__(self, wsgi_app: WSGIHandler, threads: int):
        self.wsgi_app = wsgi_app
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="http")

    async def __call__(self, scope, receive, send) -> None:
        # A body over its limit is refused from its Content-Length, before a byte of it is read.
        limit, declared, invalid = bodylimits.scope_limit(scope)
        if invalid:
            await send_response(send, bodylimits.bad_length())
            return
        if declared is not None and declared > limit:
            await send_response(send, bodylimits.too_large(declared, limit, bodylimits.is_anonymous_limit(limit)))
            return
        body = await read_body(receive, limit)
        if body is None:
            return  # the client left before it finished sending
        if body is TOO_LARGE:
            await send_response(send, bodylimits.too_large(None, limit, bodylimits.is_anonymous_limit(limit)))
            return
        loop = asyncio.get_running_loop()
        exchange = Exchange(self.wsgi_app, scope, body, loop, send)
        try:
            start, content = await loop.run_in_executor(self.pool, exchange.run)
        finally:
            body.close()
        if start is not None:
            await send(start)
            await send({"type": "http.response.body", "body": content})
            return
        # A streaming response: the thread sends it itself; meanwhile notice a disconnect.
        watcher = asyncio.ensure_future(watch_disconnect(receive, exchange.gone))
        try:
            await asyncio.wrap_future(exchange.streamed)
        finally:
            watcher.cancel()


class Exchange:
    """One request's life on its pool thread."""

    def __init__(self, wsgi_app, scope: dict, body, loop: asyncio.AbstractEventLoop, send):
        self.wsgi_app, self.scope, self.body, self.loop, self.send = wsgi_app, scope, body, loop, send
        self.status, self.headers = 500, []
        self.gone = threading.Event()
        self.streamed: concurrent.futures.Future = concurrent.futures.Future()

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info=None) -> None:
        self.status = int(status.split(" ", 1)[0])
        # Django writes Set-Cookie values with a leading space (`cookie.output(header="")`),
        # which WSGI servers strip and h11 refuses.
        self.headers = [(name.lower().encode("latin-1"), value.strip().encode("latin-1")) for name, value in headers]

    def run(self) -> tuple[dict | None, bytes]:
        """The response's start and whole body; or (None, b"") once a streaming response
        has been handed to a thread of its own to send."""
        response = self.wsgi_app(environ(self.scope, self.body), self.start_response)
        if not getattr(response, "streaming", False):
            try:
                content = b"".join(response)
            finally:
                close(response)  # request_finished: the connection goes back to the pool
            return self.start(), content
        # The stream reads on a thread of its own, with a database connection of its own.
        close_old_connections()
        threading.Thread(target=self.stream, args=(response,), name="http-stream", daemon=True).start()
        return None, b""

    def start(self) -> dict:
        return {"type": "http.response.start", "status": self.status, "headers": self.headers}

    def stream(self, response) -> None:
        """Send a streaming response piece by piece; request_finished runs here at the end."""
        try:
            self.send_now(self.start())
            pending: list[bytes] = []
            size = 0
            for chunk in response:
                if self.gone.is_set():
                    break
                pending.append(chunk)
                size += len(chunk)
                if size >= STREAM_CHUNK:
                    self.send_now({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                    pending, size = [], 0
            if not self.gone.is_set():
                self.send_now({"type": "http.response.body", "body": b"".join(pending)})
            self.streamed.set_result(None)
        except BaseException as exc:  # handed to the awaiting request, which raises it
            self.streamed.set_exception(exc)
        finally:
            close(response)

    def send_now(self, message: dict) -> None:
        asyncio.run_coroutine_threadsafe(self.send(message), self.loop).result()


def close(response) -> None:
    """PEP 3333: the server calls the iterable's close(), when it has one."""
    if hasattr(response, "close"):
        response.close()


TOO_LARGE = object()  # read_body's answer for a body (sent without Content-Length) past its limit


async def send_response(send, response) -> None:
    """A small Django response sent from the event loop (no pool thread, no body read)."""
    headers = [(b"content-type", response["Content-Type"].encode("latin-1")), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


async def read_body(receive, limit: int | None = None):
    body = SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            body.close()
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            body.close()
            return TOO_LARGE
        body.write(chunk)
        if not message.get("more_body"):
            body.seek(0)
            return body


async def watch_disconnect(receive, gone: threading.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def environ(scope: dict, body) -> dict:
    """The WSGI environ (PEP 3333) for an ASGI http scope."""
    script_name = scope.get("root_path", "").encode().decode("latin-1")
    path = scope["path"].encode().decode("latin-1")
    server = scope.get("server") or ("localhost", 80)
    result = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": script_name,
        "PATH_INFO": path[len(script_name) :] if path.startswith(script_name) else path,
        "QUERY_STRING": scope["query_string"].decode("latin-1"),
        "SERVER_NAME": server[0],
        "SERVER_PORT": str(server[1] or 0),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    if scope.get("client"):
        result["REMOTE_ADDR"] = scope["client"][0]
    headers = defaultdict(list)
    for name, value in scope.get("headers", []):
        key = name.decode("latin-1").upper().replace("-", "_")
        headers[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"].append(value.decode("latin-1"))
    for key, values in headers.items():
        result[key] = ("; " if key == "HTTP_COOKIE" else ",").join(values)
    return result
