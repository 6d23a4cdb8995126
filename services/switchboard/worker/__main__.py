"""Worker process entry: ``python -m switchboard.worker --startup-json JSON``.

The engine's executor starts one per device and hands it a :class:`WorkerStartup` (the ring to
read calls from, the address to send replies to, the engine's config). The process title is
``switchboard::Worker_DP<r>_PP<p>_TP<t>``. Exit code 0 after ``shutdown``, SIGTERM/SIGINT or
the parent's death; 1 when the loop itself fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

import msgspec
import setproctitle
import torch
import zmq

from switchboard.config import EngineConfig, decode_config
from switchboard.wire.codec import WORKER_STARTUP
from switchboard.wire.step_msgs import WorkerStartup
from switchboard.worker.distributed import leave_parallel_group
from switchboard.worker.threads import torch_threads
from switchboard.worker.worker import Worker, run_busy_loop

logger = logging.getLogger("switchboard.worker")

REPLY_LINGER_MS = 2000  # time to flush the last reply (shutdown's) after the loop ends


def process_name(startup: WorkerStartup) -> str:
    return f"Worker_DP{startup.data_parallel_rank}_PP{startup.pp_rank}_TP{startup.tp_rank}"


def parse_startup(argv: list[str] | None) -> WorkerStartup:
    parser = argparse.ArgumentParser(prog="python -m switchboard.worker")
    parser.add_argument("--startup-json", required=True, help="a WorkerStartup, JSON-encoded")
    args = parser.parse_args(argv)
    return WORKER_STARTUP.decode(args.startup_json)


def configure_logging(name: str) -> None:
    level = os.environ.get("SWITCHBOARD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {name} pid=%(process)d %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def attach_ring(ring_handle: Any, rank: int):
    from switchboard.wire.shm_ring import RingHandle, ShmRingReader

    return ShmRingReader(msgspec.convert(ring_handle, RingHandle), rank)


def main(argv: list[str] | None = None) -> int:
    startup = parse_startup(argv)
    name = process_name(startup)
    setproctitle.setproctitle(f"switchboard::{name}")
    configure_logging(name)
    config = decode_config(startup.engine_config_json, EngineConfig)

    stop: dict[str, str | None] = {"signal": None}

    def request_stop(signum: int, _frame: object) -> None:
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    workers_on_host = config.worker.workers_on_host or config.parallel.world_size
    torch.set_num_threads(torch_threads(config.worker.torch_threads, workers_on_host))
    torch.manual_seed(config.model.seed)
    logger.info(
        "starting: rank %d of %d, parent pid %d, torch threads %d (%s), OpenMP wait policy %s, "
        "model %s",
        startup.rank,
        startup.world_size,
        startup.parent_pid,
        torch.get_num_threads(),
        "configured" if config.worker.torch_threads > 0 else f"auto, {workers_on_host} on host",
        os.environ.get("OMP_WAIT_POLICY", "libgomp's default"),
        config.model.model,
    )

    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
    replies.connect(startup.reply_address)
    reader = None
    exit_code = 0
    try:
        reader = attach_ring(startup.ring_handle, startup.rank)
        worker = Worker(config, startup.rank, startup.distributed_init_method)
        reason = run_busy_loop(
            worker,
            reader,
            replies,
            startup.parent_pid,
            lambda: stop["signal"] is not None,
            freeze_heap=True,
        )
        if reason == "signal":
            reason = f"signal {stop['signal']}"
        logger.info("stopping: %s", reason)
    except Exception:
        logger.exception("worker failed")
        exit_code = 1
    finally:
        if reader is not None:
            reader.close()
        leave_parallel_group()
        replies.close()
        context.term()
    logger.info("exited with code %d", exit_code)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
