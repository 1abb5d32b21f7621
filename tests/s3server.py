"""A real S3 endpoint on loopback for the tests: `moto` in server mode (its own process,
spoken to over HTTP by botocore/s3fs exactly as a cloud endpoint is), not an in-process
mock of the client library."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

ACCESS_KEY = "AKIABERTPIPETESTKEY0"
SECRET_KEY = "bertpipe-test-secret-value-0"  # moto without auth accepts any pair


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(port: int) -> list[str]:
    # this file's own entry point: moto's server with two per-request costs taken out
    return [sys.executable, __file__, "-H", "127.0.0.1", "-p", str(port)]


def _serve(argv: list[str]) -> None:
    """moto's `moto_server`, less two costs paid on every request (a quarter of its CPU in
    the object-store tests): finding the backend lists moto's package folder (a
    directory listing and a stat per entry) where the list never changes, and werkzeug logs
    a line per request (errors are still logged)."""
    import logging

    from moto import backends
    from moto.server import main

    listed = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: listed  # type: ignore[assignment]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    main(argv)


@contextlib.contextmanager
def moto_server(env: dict[str, str] | None = None, timeout: float = 60) -> Iterator[str]:
    """The endpoint URL of a moto server started for the block (another port if the chosen
    one was taken in the meantime). Its log goes to a file: it writes a line per request,
    and a pipe nobody reads would fill and stop the server."""
    error = ""
    for _ in range(3):
        port = free_port()
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(_command(port), env={**os.environ, **(env or {})},
                                    stdout=subprocess.DEVNULL, stderr=log,
                                    start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            try:
                if _wait_ready(proc, url, timeout):
                    yield url
                    return
                log.seek(0)
                error = log.read().decode(errors="replace")
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    raise RuntimeError(f"moto_server did not start: {error[-2000:]}")


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + "/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer: it serves
        except OSError:
            time.sleep(0.1)
    return False


def reset(url: str) -> None:
    """Forget every bucket and object (cheaper than a new server per test)."""
    request = urllib.request.Request(url + "/moto-api/reset", method="POST")
    urllib.request.urlopen(request, timeout=10).read()


def environment(url: str) -> dict[str, str]:
    """The AWS variables by which botocore (and so s3fs) finds this endpoint."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": url, "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1"}


def make_bucket(url: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                 aws_access_key_id=ACCESS_KEY,
                 aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=name)


def iam_credentials(url: str) -> tuple[str, str]:
    """On a server started with INITIAL_NO_AUTH_ACTION_COUNT: a user allowed everything on
    S3, and its key pair (the server checks signatures from then on)."""
    import boto3

    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1",
                       aws_access_key_id="x", aws_secret_access_key="x")
    iam.create_user(UserName="bertpipe")
    key = iam.create_access_key(UserName="bertpipe")["AccessKey"]
    iam.put_user_policy(UserName="bertpipe", PolicyName="s3", PolicyDocument=json.dumps(
        {"Version": "2012-10-17",
         "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    return str(key["AccessKeyId"]), str(key["SecretAccessKey"])


@contextlib.contextmanager
def served(server: Any) -> Iterator[int]:
    """A socketserver-style `server` (http.server, werkzeug) answering on a thread of this
    process for the block; its port. Shut down and closed after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


if __name__ == "__main__":
    _serve(sys.argv[1:])
