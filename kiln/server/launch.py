"""`kiln serve`: an engine process (EngineCore over ZMQ) and this process (FastAPI + uvicorn).

The model is resolved here first, so a GGUF file is converted once and the engine process loads
the converted directory. Ctrl-C or SIGTERM stops uvicorn gracefully, then the engine; the engine
also dies on its own if this process dies (PR_SET_PDEATHSIG, plus a parent check when idle).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from kiln.config import EngineConfig
from kiln.dist.net import free_port

logger = logging.getLogger("kiln.server")

READY_TIMEOUT_S = 1800.0  # loading a large checkpoint from a slow disk can take minutes


class ServerStartupError(RuntimeError):
    """The server could not start; the message says why and what to change."""


def launch_server(config: EngineConfig) -> None:
    """Start the engine process, wait until it is ready, then serve HTTP until stopped."""
    import uvicorn

    from kiln.engine.cache.hicache_config import HiCacheConfig
    from kiln.loader import resolve_model
    from kiln.server.app import create_app
    from kiln.server.scheduler_process import run_scheduler
    from kiln.server.tokenizer_manager import TokenizerManager

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _check_port(config.host, config.port)
    HiCacheConfig.from_engine_config(config)  # bad HiCache flags: a clear error before anything starts
    source = resolve_model(config.model_path, config.load_format)  # converts a GGUF once, here
    aliases = {p for p in (config.model_path, source.model_dir) if p}
    if config.model_path:
        aliases.add(os.path.abspath(os.path.expanduser(config.model_path)))
    engine_config = dataclasses.replace(config, model_path=source.model_dir, load_format=source.load_format,
                                        served_model_name=config.served_model_name or source.name)

    # SIGTERM before uvicorn takes over the signals must still run the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ipc_dir = tempfile.mkdtemp(prefix="kiln-ipc-")
    to_engine, from_engine = f"ipc://{ipc_dir}/to_engine", f"ipc://{ipc_dir}/from_engine"
    ctx = mp.get_context("spawn")
    # One engine process per tensor-parallel rank; rank 0 talks to this process.
    tp_init = f"tcp://127.0.0.1:{free_port()}"
    procs, readers = [], []
    for rank in range(config.tp_size):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_scheduler, args=(engine_config, to_engine, from_engine, writer, rank, tp_init),
                           name=f"kiln-engine-tp{rank}" if config.tp_size > 1 else "kiln-engine", daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)
    try:
        info = [_wait_ready(proc, reader, procs) for proc, reader in zip(procs, readers)][0]
        logger.info("Serving %s on http://%s:%d (context %d%s)", info.name, config.host, config.port,
                    info.context_length, f", tp {config.tp_size}" if config.tp_size > 1 else "")
        tm = TokenizerManager(engine_config, info, to_engine, from_engine, lambda: all(p.is_alive() for p in procs))
        app = create_app(engine_config, tm, aliases)
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                               timeout_graceful_shutdown=5))
        server.run()
    finally:
        for proc in procs:
            _stop(proc)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _wait_ready(proc: Any, reader: Any, group: list) -> Any:
    """The engine's ModelInfo, or a ServerStartupError carrying the engine's own error. `group`:
    every rank's process (a rank that dies leaves the others waiting in a collective)."""
    import time

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if reader.poll(0.5):
            try:
                status, payload = reader.recv()
            except EOFError:
                break
            if status == "ok":
                return payload
            raise ServerStartupError(f"The engine failed to start:\n{payload}")
        if not all(p.is_alive() for p in group):
            break
    proc.join(timeout=1)
    dead = [p for p in group if not p.is_alive()]
    raise ServerStartupError(f"The engine process {dead[0].name} exited (code {dead[0].exitcode}) before it was "
                             "ready; see its log above." if dead else
                             f"The engine was not ready after {READY_TIMEOUT_S:.0f}s.")


def _stop(proc: Any) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)



def _check_port(host: str, port: int) -> None:
    """Fail before loading the model when the port is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServerStartupError(f"Cannot listen on {host}:{port} ({e.strerror}); pass a free --port "
                                     "or stop the process using it.") from e
