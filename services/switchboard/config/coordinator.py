"""The coordinator's config (DP > 1): engines' load in, one report to every gateway out."""

from typing import Annotated

from switchboard.common.flags import AT_LEAST_1, Flag, Group
from switchboard.config.struct import Config, curve_keys_flag


class CoordinatorConfig(Config, frozen=True):
    """The coordinator (only when DP > 1): engines' load in, one report to every gateway out."""

    input_address: str  # PULL bind: EngineLoad from every engine
    publish_address: str  # PUB bind: LoadReport to every gateway
    num_engines: Annotated[
        int,
        Flag(
            "engines expected (the deployment's DP size; for its log lines)",
            Group.COORDINATOR,
            name="--data-parallel-size",
            aliases=("-dp",),
            accepts=AT_LEAST_1,
        ),
    ] = 1
    publish_interval_s: float = 0.1  # at most this often, when something changed
    keepalive_interval_s: float = 5.0  # at least this often, changed or not
    curve_keys_dir: Annotated[str, curve_keys_flag(Group.COORDINATOR)] = ""
