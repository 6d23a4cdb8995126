"""Process entry of an engine core: ``python -m switchboard.engine --config-json JSON``.

``JSON`` is ``config.encode_config(EngineConfig(...))``. The process exits 0 after a clean
shutdown (SIGTERM/SIGINT), ``START_FAILED`` (common/exit_codes.py) when its start-up failed, and
1 after a fatal error while serving.
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys

import setproctitle

from switchboard.common.exit_codes import START_FAILED
from switchboard.config import EngineConfig, decode_config
from switchboard.engine import teardown
from switchboard.engine.core import EngineCore
from switchboard.engine.io_threads import InputQueue
from switchboard.engine.shutdown import ShutdownRequest

logger = logging.getLogger("switchboard.engine")  # not __name__: that is "__main__" under -m


def run_engine_core(config: EngineConfig) -> int:
    """Body of the process ``switchboard::EngineCore_DP<rank>``; returns its exit code."""
    setproctitle.setproctitle(f"switchboard::EngineCore_DP{config.data_parallel_rank}")
    input_queue: InputQueue = queue.Queue()
    shutdown = ShutdownRequest(input_queue)
    # Installed before the (long) start-up: a signal meanwhile is kept and acted on after it.
    signal.signal(signal.SIGTERM, shutdown.on_signal)
    signal.signal(signal.SIGINT, shutdown.on_signal)
    core = EngineCore(config, shutdown, input_queue)
    started = False
    try:
        core.start()
        started = True
        core.run_busy_loop()
        return 0
    except Exception:
        if started:
            logger.exception("EngineCore encountered a fatal error")
        else:
            logger.exception("EngineCore failed to start")
        teardown.send_engine_dead(core)
        return 1 if started else START_FAILED
    finally:
        teardown.shutdown(core)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchboard.engine")
    parser.add_argument("--config-json", required=True, help="an encoded EngineConfig")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    config = decode_config(args.config_json, EngineConfig)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s EngineCore_DP{config.data_parallel_rank} "
        "%(name)s: %(message)s",
    )
    return run_engine_core(config)


if __name__ == "__main__":
    sys.exit(main())
