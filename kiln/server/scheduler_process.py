"""The engine process: owns the EngineCore and talks to the API process over ZMQ.

Loop: drain every pending message without blocking, run one scheduler step if there is work,
otherwise block on the socket (short timeout, to notice a dead parent). Messages in:
GenerateReq, AbortReq, FlushCacheReq, StatsReq. Messages out (pickled): BatchOutput,
FlushCacheResult, SchedulerStats.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.io import (AbortReq, BatchOutput, FlushCacheReq, FlushCacheResult, GenerateReq,
                            ReqOutput, StatsReq)

logger = logging.getLogger("kiln.scheduler")

IDLE_POLL_MS = 1000  # how long an idle loop blocks before checking that the parent lives


def run_scheduler(config: EngineConfig, recv_addr: str, send_addr: str, ready_pipe: Any) -> None:
    """Entry point of the engine process (multiprocessing spawn target).

    Sends ("ok", ModelInfo) or ("error", traceback text) through `ready_pipe` once, then serves
    until the parent dies or it receives SIGTERM.
    """
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; let the parent decide when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _die_with_parent()
    parent = os.getppid()

    import zmq

    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    try:
        from kiln.engine.core import EngineCore

        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - report every startup failure to the parent
        ready_pipe.send(("error", f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}"))
        ready_pipe.close()
        return
    ready_pipe.send(("ok", core.info))
    ready_pipe.close()
    logger.info("Engine ready: %s (context %d)", core.info.name, core.info.context_length)

    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    try:
        while True:
            while True:
                try:
                    msg = recv.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                _handle(core, msg, send)
            if core.has_work():
                outs = core.step()
                if outs:
                    send.send_pyobj(BatchOutput(outs))
            elif not poller.poll(IDLE_POLL_MS) and os.getppid() != parent:
                logger.warning("The API process is gone; stopping the engine.")
                return
    except Exception:
        logger.exception("Engine loop failed; the server cannot continue.")
        raise
    finally:
        recv.close(linger=0)
        send.close(linger=0)
        ctx.term()


def _handle(core: Any, msg: Any, send: Any) -> None:
    """Apply one message. A bad request fails alone: it never stops the loop."""
    if isinstance(msg, GenerateReq):
        try:
            core.add_request(msg)
        except Exception as e:  # noqa: BLE001
            logger.warning("Rejected request %s: %s", msg.rid, e)
            send.send_pyobj(BatchOutput([ReqOutput(msg.rid, [], finished=True, finish_reason="abort",
                                                   error=f"{type(e).__name__}: {e}")]))
    elif isinstance(msg, AbortReq):
        try:
            core.abort(msg.rid)
        except Exception:  # noqa: BLE001 - aborting an unknown or finished request is harmless
            logger.debug("Abort of %s failed", msg.rid, exc_info=True)
    elif isinstance(msg, FlushCacheReq):
        ok = core.flush_cache()
        send.send_pyobj(FlushCacheResult(ok, "" if ok else "Requests are running; flush when idle."))
    elif isinstance(msg, StatsReq):
        send.send_pyobj(core.stats())
    else:
        logger.error("Unknown message %r ignored", type(msg).__name__)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the parent dies, so no orphan engine holds memory."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # the getppid check in the loop still catches it
