"""HTTP through Django's synchronous handler on a pool of threads (portal.sync_http)."""

import asyncio
import io
import json
import threading

from portal.sync_http import STREAM_CHUNK, SyncHttpApp, environ


def scope(method: str = "GET", path: str = "/", query: bytes = b"", headers=(), **extra) -> dict:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "query_string": query,
        "root_path": "",
        "headers": list(headers),
        "client": ("10.0.0.7", 51000),
        "server": ("127.0.0.1", 8000),
        **extra,
    }


def call(app: SyncHttpApp, request_scope: dict, body: bytes = b"", disconnect_after: int | None = None) -> list[dict]:
    """Run one request through the app; the messages it sent. With `disconnect_after`, the
    client goes away once that many body messages have arrived."""
    sent: list[dict] = []

    async def exchange():
        gone = asyncio.Event()
        pieces = [
            {"type": "http.request", "body": body[:3], "more_body": True},
            {"type": "http.request", "body": body[3:]},
        ]

        async def receive():
            if pieces:
                return pieces.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            bodies = sum(1 for m in sent if m["type"] == "http.response.body")
            if disconnect_after is not None and bodies >= disconnect_after:
                gone.set()
                await asyncio.sleep(0.05)  # let the watcher see the disconnect before the next piece

        await asyncio.wait_for(app(request_scope, receive, send), 10)

    asyncio.run(exchange())
    return sent


def echo_app(environ_seen: dict, start_response):
    """A WSGI app answering with what it was given."""
    body = environ_seen["wsgi.input"].read()
    start_response("201 Created", [("Content-Type", "application/json"), ("X-Thread", threading.current_thread().name)])
    keys = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "CONTENT_TYPE", "HTTP_AUTHORIZATION", "REMOTE_ADDR")
    return [json.dumps({"body": body.decode(), **{key: environ_seen.get(key) for key in keys}}).encode()]


def test_a_request_runs_on_a_pool_thread_with_its_whole_body():
    app = SyncHttpApp(echo_app, threads=2)
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer abc")]
    sent = call(app, scope("POST", "/api/v1/jobs/", b"x=1", headers), body=b'{"name": "train"}')

    start, body = sent
    assert start["status"] == 201
    assert (b"x-thread", b"http_0") in start["headers"] or (b"x-thread", b"http_1") in start["headers"]
    assert json.loads(body["body"]) == {
        "body": '{"name": "train"}',
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/api/v1/jobs/",
        "QUERY_STRING": "x=1",
        "CONTENT_TYPE": "application/json",
        "HTTP_AUTHORIZATION": "Bearer abc",
        "REMOTE_ADDR": "10.0.0.7",
    }
    assert not body.get("more_body")


def test_the_environ_follows_pep_3333():
    headers = [(b"cookie", b"a=1"), (b"cookie", b"b=2"), (b"accept", b"text/html"), (b"accept", b"*/*")]
    headers.append((b"content-length", b"0"))
    result = environ(scope(path="/jobs/r\u00e9sum\u00e9/", root_path="", headers=headers), io.BytesIO())

    assert result["PATH_INFO"] == "/jobs/résumé/".encode().decode("latin-1")  # UTF-8 bytes as latin-1
    assert result["HTTP_COOKIE"] == "a=1; b=2"
    assert result["HTTP_ACCEPT"] == "text/html,*/*"
    assert result["CONTENT_LENGTH"] == "0" and "HTTP_CONTENT_LENGTH" not in result
    server = (result["SERVER_NAME"], result["SERVER_PORT"], result["SERVER_PROTOCOL"])
    assert server == ("127.0.0.1", "8000", "HTTP/1.1")
    assert environ(scope(path="/hangar/api/", root_path="/hangar"), io.BytesIO())["PATH_INFO"] == "/api/"


class Streaming:
    """A streaming response as Django's WSGI handler returns it."""

    streaming = True

    def __init__(self, pieces: int, size: int):
        self.pieces, self.size, self.made, self.closed = pieces, size, 0, threading.Event()

    def __iter__(self):
        for _ in range(self.pieces):
            self.made += 1
            yield b"x" * self.size

    def close(self):
        self.closed.set()


def test_a_streaming_response_is_sent_in_pieces_of_at_least_the_chunk_size():
    response = Streaming(pieces=100, size=4096)

    def app(environ_seen, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return response

    sent = call(SyncHttpApp(app, threads=1), scope())

    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert sent[0]["status"] == 200
    assert b"".join(m["body"] for m in bodies) == b"x" * 409600
    assert all(len(m["body"]) >= STREAM_CHUNK for m in bodies[:-1])
    assert [m.get("more_body", False) for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert response.closed.wait(5)


def test_a_streaming_response_stops_when_the_client_goes_away():
    response = Streaming(pieces=10_000, size=STREAM_CHUNK)

    def app(environ_seen, start_response):
        start_response("200 OK", [])
        return response

    call(SyncHttpApp(app, threads=1), scope(), disconnect_after=2)

    assert response.closed.wait(5)  # request_finished still runs
    assert response.made < 100


def test_a_streaming_response_frees_its_pool_thread():
    """A long download does not hold the pool: with one thread, another request is answered
    while the download is still being sent."""
    release = threading.Event()

    def slow_pieces():
        yield b"first"
        release.wait(10)
        yield b"last"

    class Download(Streaming):
        def __iter__(self):
            return slow_pieces()

    def app(environ_seen, start_response):
        start_response("200 OK", [])
        return Download(0, 0) if environ_seen["PATH_INFO"] == "/download" else [b"quick"]

    app_under_test = SyncHttpApp(app, threads=1)
    download = threading.Thread(target=call, args=(app_under_test, scope(path="/download")))
    download.start()
    try:
        quick = call(app_under_test, scope(path="/quick"))
        assert quick[1]["body"] == b"quick"
    finally:
        release.set()
        download.join(10)


def test_hangar_pages_and_the_api_answer_through_it():
    """The project's own application: a page, a static file and an API error, in-process."""
    from portal.asgi import application

    async def get(path: str) -> list[dict]:
        sent, asked = [], []

        async def receive():
            if asked:
                await asyncio.Event().wait()  # the client stays until the answer is whole
            asked.append(True)
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        await application(scope(path=path, headers=[(b"host", b"127.0.0.1")]), receive, send)
        return sent

    login = asyncio.run(get("/login/"))
    assert login[0]["status"] == 200 and b"<form" in b"".join(m.get("body", b"") for m in login[1:])
    cookies = [value for name, value in login[0]["headers"] if name == b"set-cookie"]
    assert cookies and all(value == value.strip() for value in cookies)  # h11 refuses padded values
    script = asyncio.run(get("/static/vendor/htmx.min.js"))
    assert script[0]["status"] == 200 and len(b"".join(m.get("body", b"") for m in script[1:])) > 10_000
    api = asyncio.run(get("/api/v1/jobs/"))
    assert api[0]["status"] == 401
    assert json.loads(b"".join(m.get("body", b"") for m in api[1:]))["code"] == "not_authenticated"
