"""Start and stop a real `kiln serve` subprocess for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Iterator, Optional

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def kiln_server(args: list[str], timeout: float = 180, env: Optional[dict] = None
                ) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kiln serve ARGS --port <free>` until healthy; yields (url, process); stops it by pid.
    A port taken between `free_port` and the server's bind (another test worker's server or
    client) gets one more try on a new port."""
    deadline = time.time() + timeout
    for attempt in range(3):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", *args, "--port", str(port)], cwd=ROOT,
                                env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            if _wait_healthy(proc, url, deadline, last_attempt=attempt == 2):
                break
        except BaseException:
            _stop(proc)
            raise
    try:
        yield url, proc
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, url: str, deadline: float, last_attempt: bool) -> bool:
    """True once the server answers /health; False if it exited because its port was taken (and
    another attempt remains); fails the test otherwise."""
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode()
            if not last_attempt and "address already in use" in out.lower():
                return False
            pytest.fail(f"kiln serve exited with {proc.returncode}:\n{out}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            pytest.fail("kiln serve did not become healthy in the time allowed")
        time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
