"""Process entry of an engine core: ``python -m switchboard.engine --config-json JSON``.

``JSON`` is ``config.encode_config(EngineConfig(...))``. The process exits 0 after a clean
shutdown (SIGTERM/SIGINT) and non-zero after a fatal error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from switchboard.config import EngineConfig, decode_config
from switchboard.engine.core import run_engine_core


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
