"""Ports for the sockets Kiln's processes open to each other (TP rendezvous, weight update
groups, servers started by a launcher)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ("" for every interface). Another process may take it
    before the caller binds it; callers that start servers retry or fail with a clear message."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
