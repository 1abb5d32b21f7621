"""A loopback S3 endpoint (moto, as the tests use) that counts what its clients send: the
bytes of every PUT and POST body and the requests by method. It runs in a thread of the
benchmark's own process, so the counts are read directly between steps."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server

from tests.s3server import served


class CountingWrites:
    """WSGI middleware: bytes uploaded (PUT and POST bodies, multipart parts included)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]):
        self.app = app
        self.lock = threading.Lock()
        self.uploaded = 0
        self.requests: collections.Counter[str] = collections.Counter()
        self.staged = 0  # of which under a store's `_bertpipe/` (staged parts, markers)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        # a streamed (aws-chunked) body says its payload size apart from its framing
        size = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get(
            "CONTENT_LENGTH") or 0
        with self.lock:
            self.requests[method] += 1
            if method in ("PUT", "POST"):
                self.uploaded += int(size)
                if "/_bertpipe/" in environ.get("PATH_INFO", ""):
                    self.staged += int(size)
        return self.app(environ, start_response)

    def take(self) -> dict[str, Any]:
        """Bytes uploaded (all, and staged), requests by method since the last call; counting
        starts over."""
        with self.lock:
            taken = {"uploaded": self.uploaded, "staged": self.staged,
                     "requests": dict(self.requests)}
            self.uploaded, self.staged, self.requests = 0, 0, collections.Counter()
        return taken


class QuietHandler(MotoRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:  # a line per request: no
        pass


@contextmanager
def counting_s3() -> Iterator[tuple[str, CountingWrites]]:
    """(endpoint URL, counter) of a moto S3 endpoint on loopback, for the block."""
    counter = CountingWrites(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True,
                         request_handler=QuietHandler)
    with served(server) as port:
        yield f"http://127.0.0.1:{port}", counter
