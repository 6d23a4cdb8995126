"""Process entry of the coordinator: ``python -m switchboard.coordinator --config-json JSON``.

JSON is a ``config.CoordinatorConfig``. The process is titled ``switchboard::Coordinator``; it
exits 0 after SIGINT/SIGTERM or when its parent (the launcher) is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import setproctitle

from switchboard.config import CoordinatorConfig, decode_config
from switchboard.coordinator.load_table import Coordinator

logger = logging.getLogger("switchboard.coordinator")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchboard.coordinator")
    parser.add_argument("--config-json", required=True, help="a CoordinatorConfig as JSON")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    config = decode_config(args.config_json, CoordinatorConfig)
    setproctitle.setproctitle("switchboard::Coordinator")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s Coordinator %(name)s: %(message)s",
    )
    stop: dict[str, str] = {}
    parent = os.getppid()

    def on_signal(signum: int, _frame: object) -> None:
        stop.setdefault("why", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def should_stop() -> bool:
        if os.getppid() != parent:
            stop.setdefault("why", f"parent process {parent} is gone")
        return bool(stop)

    coordinator = Coordinator(config)
    try:
        coordinator.run(should_stop)
    except Exception:
        logger.exception("coordinator failed")
        return 1
    finally:
        coordinator.close()
    logger.info("stopped: %s", stop.get("why", "?"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
