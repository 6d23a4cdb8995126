"""The engine core's end: the last word to every gateway (ENGINE_CORE_DEAD), and stopping the
I/O threads, the workers, the ring and the sockets.

``__main__.run_engine_core`` calls ``send_engine_dead`` after a fatal error and ``shutdown``
in every case, a failed start included.
"""

from __future__ import annotations

import gc
import logging
import shutil
from typing import TYPE_CHECKING

from switchboard.common.log_limits import report_suppressed
from switchboard.engine.output_thread import send_engine_dead_directly
from switchboard.wire.engine_msgs import ENGINE_CORE_DEAD

if TYPE_CHECKING:
    from switchboard.engine.core import EngineCore

logger = logging.getLogger(__name__)

DEAD_SEND_TIMEOUT_S = 5.0


def send_engine_dead(core: EngineCore) -> None:
    """Last word to every gateway; the output thread exits after sending it."""
    if core.output_thread is None or not core.output_thread.is_alive():
        addresses = (
            core.peers.gateway_output_addresses()
            if core.peers is not None
            else list(core.config.gateway_output_addresses)
        )
        send_engine_dead_directly(core.ctx, addresses, core.engine_index, curve=core.curve_gateway)
        return
    core.output_queue.put(ENGINE_CORE_DEAD)
    core.output_thread.join(DEAD_SEND_TIMEOUT_S)
    if core.output_thread.is_alive():
        logger.critical("ENGINE_CORE_DEAD could not be sent within %ss", DEAD_SEND_TIMEOUT_S)


def shutdown(core: EngineCore) -> None:
    """Stop the I/O threads, the workers and the ring; safe after a failed start."""
    if core.peers is not None:
        core.peers.stop()
    if core.input_thread is not None:
        core.input_thread.stop()
    if core.output_thread is not None and core.output_thread.is_alive():
        core.output_thread.stop()  # sends what is already queued first
    if core.executor is not None:
        core.executor.shutdown()
    if core.structured_output is not None:
        core.structured_output.shutdown()
    if core.kv_events is not None:
        core.kv_events.stop()
    threads = (core.input_thread, core.output_thread)
    if any(t is not None and t.is_alive() for t in threads):
        core.ctx.destroy(linger=0)  # a stuck thread must not hold the exit hostage
    else:
        core.ctx.term()
    if core.own_run_dir:
        shutil.rmtree(core.run_dir, ignore_errors=True)
    gc.unfreeze()
    report_suppressed()
    logger.info("EngineCore_DP%d shut down", core.engine_index)
