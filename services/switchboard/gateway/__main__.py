"""Process entry of a gateway: ``python -m switchboard.gateway --config-json JSON``.

JSON is a ``config.GatewayRoleConfig`` (``config.encode_config``), written by the launcher.
The process is titled ``switchboard::Gateway_<client_index>``; it exits 0 after SIGINT/SIGTERM
and non-zero when its engines die (one machine) or it cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import setproctitle

from switchboard.config import GatewayRoleConfig, decode_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchboard.gateway")
    parser.add_argument("--config-json", required=True, help="a GatewayRoleConfig as JSON")
    args = parser.parse_args(argv)
    config = decode_config(args.config_json, GatewayRoleConfig)
    setproctitle.setproctitle(f"switchboard::Gateway_{config.client_index}")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s Gateway_{config.client_index} %(name)s: %(message)s",
    )
    from switchboard.gateway.grpc_server import serve  # after logging: imports grpc

    try:
        return asyncio.run(serve(config))
    except Exception:
        logging.getLogger("switchboard.gateway").exception("gateway failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
