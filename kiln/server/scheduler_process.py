"""The engine process: owns the EngineCore and talks to the API process over ZMQ.

Loop: drain every pending message without blocking, run one scheduler step if there is work,
otherwise block on the socket (short timeout, to notice a dead parent). Messages in:
GenerateReq, AbortReq, FlushCacheReq, StatsReq and the control messages (`CONTROL_REQS`:
weight updates, memory release/resume, pause/continue, LoRA load/unload, profiling), each handled
between two steps. Messages out (pickled): BatchOutput, FlushCacheResult, SchedulerStats, ControlResult
(one per control message, in order).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.io import (CONTROL_REQS, AbortReq, BatchOutput, ContinueGenerationReq, ControlResult,
                            DestroyWeightsUpdateGroupReq, FlushCacheReq, FlushCacheResult, GenerateReq,
                            InitWeightsUpdateGroupReq, LoadLoraReq, PauseGenerationReq, ReleaseMemoryReq, ReqOutput,
                            ResumeMemoryReq, StartProfileReq, StatsReq, StopProfileReq, UnloadLoraReq,
                            UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq)

logger = logging.getLogger("kiln.scheduler")

IDLE_POLL_MS = 1000  # how long an idle loop blocks before checking that the parent lives


def run_scheduler(config: EngineConfig, recv_addr: str, send_addr: str, ready_pipe: Any,
                  tp_rank: int = 0, tp_init_method: str = "") -> None:
    """Entry point of an engine process (multiprocessing spawn target), one per tensor-parallel
    rank.

    Sends ("ok", ModelInfo) or ("error", traceback text) through `ready_pipe` once, then serves
    until the parent dies or it receives SIGTERM. With `--tp N`, rank 0 alone talks to the API
    process: each loop it broadcasts the messages it received to the other ranks, every rank
    applies them and steps its own scheduler (identical decisions, see `kiln.dist.init`), and
    only rank 0 sends outputs back.
    """
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(name)s{f'[tp{tp_rank}]' if config.tp_size > 1 else ''} "
                               "%(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; let the parent decide when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _die_with_parent()
    parent = os.getppid()
    leader = tp_rank == 0

    import zmq

    ctx = zmq.Context()
    recv = send = None
    if leader:
        recv = ctx.socket(zmq.PULL)
        recv.bind(recv_addr)
        send = ctx.socket(zmq.PUSH)
        send.connect(send_addr)
    try:
        from kiln.dist.init import init_tensor_parallel
        from kiln.engine.core import EngineCore
        from kiln.engine.gc_tuning import tune_gc

        pc = init_tensor_parallel(tp_rank, config.tp_size, tp_init_method, config.resolved_device())
        core = EngineCore(config, pc=pc)
        tune_gc()  # for the process's life
    except BaseException as e:  # noqa: BLE001 - report every startup failure to the parent
        ready_pipe.send(("error", f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}"))
        ready_pipe.close()
        return
    ready_pipe.send(("ok", core.info))
    ready_pipe.close()
    logger.info("Engine ready: %s (context %d)", core.info.name, core.info.context_length)
    out = send if leader else _Discard()

    poller = zmq.Poller()
    if leader:
        poller.register(recv, zmq.POLLIN)
    try:
        while True:
            msgs = []
            if leader:
                # Idle: block on the socket for a while (then check that the parent lives).
                if not core.has_work() and not poller.poll(IDLE_POLL_MS) and os.getppid() != parent:
                    logger.warning("The API process is gone; stopping the engine.")
                    pc.broadcast_object(_STOP)
                    return
                while True:
                    try:
                        msgs.append(recv.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if pc.tp_size > 1:
                msgs = pc.broadcast_object(msgs)
                if msgs is _STOP or msgs == _STOP:
                    return
            for msg in msgs:
                _handle(core, msg, out)
            if core.has_work():
                outs = core.step()
                if outs:
                    out.send_pyobj(BatchOutput(outs))
    except Exception:
        logger.exception("Engine loop failed; the server cannot continue.")
        raise
    finally:
        for sock in (recv, send):
            if sock is not None:
                sock.close(linger=0)
        ctx.term()


_STOP = "stop"  # broadcast by rank 0 when it stops, so the other ranks stop too


class _Discard:
    """Where ranks other than 0 "send" their outputs: rank 0 sends the same ones."""

    def send_pyobj(self, obj: Any) -> None:
        pass


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
    elif isinstance(msg, CONTROL_REQS):
        try:
            result = control(core, msg)
        except Exception as e:  # noqa: BLE001 - a failed control call is reported, not fatal
            logger.warning("%s failed: %s", type(msg).__name__, e)
            result = ControlResult(False, f"{type(e).__name__}: {e}" if not isinstance(e, (RuntimeError, ValueError))
                                   else str(e))
        # Aborts from pause_generation("abort") go out before the reply.
        if core.has_work() and core.blocked:
            outs = core.step()
            if outs:
                send.send_pyobj(BatchOutput(outs))
        send.send_pyobj(result)
    else:
        logger.error("Unknown message %r ignored", type(msg).__name__)


def control(core: Any, msg: Any) -> ControlResult:
    """Apply one RL control message to an EngineCore (raises on failure)."""
    if isinstance(msg, UpdateWeightsFromTensorReq):
        n = core.update_weights_from_tensor(msg.named_tensors, flush_cache=msg.flush_cache)
        return ControlResult(True, f"Updated {n} tensors.", {"num_tensors": n})
    if isinstance(msg, InitWeightsUpdateGroupReq):
        core.init_weights_update_group(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                                       msg.group_name, msg.backend, msg.timeout_s)
        return ControlResult(True, f"Joined weight update group {msg.group_name!r}.")
    if isinstance(msg, UpdateWeightsFromDistributedReq):
        n = core.update_weights_from_distributed(msg.names, msg.dtypes, msg.shapes, msg.group_name, msg.flush_cache)
        return ControlResult(True, f"Updated {n} tensors from group {msg.group_name!r}.", {"num_tensors": n})
    if isinstance(msg, DestroyWeightsUpdateGroupReq):
        core.destroy_weights_update_group(msg.group_name)
        return ControlResult(True, f"Weight update group {msg.group_name!r} destroyed.")
    if isinstance(msg, StartProfileReq):
        path = core.start_profile(msg.options)
        until = f"after {msg.options.num_steps} steps" if msg.options.num_steps else "at /stop_profile"
        return ControlResult(True, f"Profiling; the trace goes to {path} {until}.", {"trace_path": path})
    if isinstance(msg, StopProfileReq):
        path = core.stop_profile()
        return ControlResult(True, f"Trace written to {path}.", {"trace_path": path})
    if isinstance(msg, UpdateWeightsFromDiskReq):
        n = core.update_weights_from_disk(msg.model_path, flush_cache=msg.flush_cache)
        return ControlResult(True, f"Loaded {n} tensors from {msg.model_path}.", {"num_tensors": n})
    if isinstance(msg, ReleaseMemoryReq):
        extra = core.release_memory_occupation(msg.tags)
        return ControlResult(True, "Memory released.", extra)
    if isinstance(msg, ResumeMemoryReq):
        core.resume_memory_occupation(msg.tags)
        return ControlResult(True, "Memory resumed.")
    if isinstance(msg, PauseGenerationReq):
        n = core.pause_generation(msg.mode)
        return ControlResult(True, f"Generation paused ({msg.mode}); {n} requests "
                             f"{'aborted' if msg.mode == 'abort' else 'retracted' if msg.mode == 'retract' else 'kept'}.",
                             {"num_requests": n})
    if isinstance(msg, ContinueGenerationReq):
        core.continue_generation()
        return ControlResult(True, "Generation continued.")
    if isinstance(msg, LoadLoraReq):
        core.load_lora_adapter(msg.name, msg.path)
        return ControlResult(True, f"LoRA adapter {msg.name!r} loaded.")
    if isinstance(msg, UnloadLoraReq):
        core.unload_lora_adapter(msg.name)
        return ControlResult(True, f"LoRA adapter {msg.name!r} unloaded.")
    raise TypeError(f"not a control message: {type(msg).__name__}")


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
