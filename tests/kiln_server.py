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
    """`kiln serve ARGS --port <free>` until healthy; yields (url, process); stops it by pid."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", *args, "--port", str(port)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kiln serve exited with {proc.returncode}:\n{proc.stdout.read().decode()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"kiln serve did not become healthy in {timeout:.0f} s")
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
