"""The gateway process's config: its fronts (gRPC, HTTP), admission, observability, TLS."""

from typing import Annotated

from switchboard.common.defaults import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT
from switchboard.common.flags import (
    AT_LEAST_0,
    AT_LEAST_1,
    NO_CAP_OR_MORE,
    POSITIVE,
    Accepts,
    Flag,
    Group,
)
from switchboard.config.model import ModelConfig
from switchboard.config.struct import Config, curve_keys_flag

DEFAULT_SHUTDOWN_GRACE_S = 30.0  # SIGTERM: how long in-flight streams get (the chart matches it)
# The gateway's secrets, from the environment (never in a config): API keys one per line, the
# AdminService token and the token /metrics asks for.
API_KEYS_ENV = "SWITCHBOARD_API_KEYS"
ADMIN_TOKEN_ENV = "SWITCHBOARD_ADMIN_TOKEN"
METRICS_TOKEN_ENV = "SWITCHBOARD_METRICS_TOKEN"
DEFAULT_STALL_WARN_S = 5.0


def _log_stats_off(disabled: bool) -> float | None:
    return 0.0 if disabled else None


def _http_port(port: int) -> int | None:
    return None if port < 0 else port


class GatewayConfig(Config, frozen=True):
    host: Annotated[str, Flag("address the gRPC server binds on", Group.GATEWAY)] = "0.0.0.0"
    port: Annotated[int, Flag("the gRPC server's port", Group.GATEWAY)] = DEFAULT_GRPC_PORT
    # The OpenAI-compatible HTTP API (gateway/http/) on this port + client_index; 0 = a free
    # port; None = off. `serve`/`gateway` default to 8000 (as vLLM); the config itself to off.
    http_port: Annotated[
        int | None,
        Flag(
            "the OpenAI-compatible HTTP API's port (gateway i of one machine: port + i; "
            "0: a free port, logged; -1: no HTTP API)",
            Group.GATEWAY,
            default=DEFAULT_HTTP_PORT,
            accepts=Accepts(-1, 65535, says="a port, 0 (a free port) or -1 (no HTTP API)"),
            to_config=_http_port,
        ),
    ] = None
    # DP > 1: which engine gets a request (gateway/engines/prefix_routing.py, pool.py).
    routing_policy: Annotated[
        str,
        Flag(
            "with several engines (-dp): prefix: to the engine holding the longest cached "
            "prefix of the prompt, within the two limits below; power-of-two: the less loaded "
            "of two engines drawn at random",
            Group.GATEWAY,
            choices=("prefix", "power-of-two"),
        ),
    ] = "prefix"
    prefix_routing_min_match: Annotated[
        int,
        Flag(
            "prefix routing: follow a cached prefix only when it is at least this many tokens "
            "longer than the shortest any engine holds (a shared system prompt gains nothing), "
            "and this many more per request that engine has above the least-loaded one",
            Group.GATEWAY,
            metavar="TOKENS",
            accepts=AT_LEAST_1,
        ),
    ] = 64
    prefix_routing_max_imbalance: Annotated[
        float,
        Flag(
            "prefix routing: never follow a cached prefix to an engine with more than this "
            "many requests (running + waiting) above the least-loaded engine",
            Group.GATEWAY,
            metavar="REQUESTS",
            accepts=AT_LEAST_0,
        ),
    ] = 8.0
    prefix_routing_running_weight: Annotated[
        float,
        Flag(
            "prefix routing: what a running request weighs in that load difference against 1 "
            "for a waiting one (a decoding request delays a newcomer's prefill by a token a "
            "step, a waiting one by its whole prompt); 1: both alike, as power of two counts "
            "them",
            Group.GATEWAY,
            metavar="WEIGHT",
            accepts=Accepts(0, 1),
        ),
    ] = 0.25
    enable_admin: Annotated[
        bool, Flag("serve AdminService (allow-listed engine utilities)", Group.GATEWAY)
    ] = False
    # Admission control (gateway/admission.py), per gateway process.
    max_inflight_requests: Annotated[
        int,
        Flag(
            "Generate calls one gateway process serves at once; more get RESOURCE_EXHAUSTED "
            "with a retry delay (0: no cap)",
            Group.GATEWAY,
            accepts=NO_CAP_OR_MORE,
        ),
    ] = 1024
    max_queued_prompt_tokens: Annotated[
        int,
        Flag(
            "prompt tokens one gateway process holds waiting for their first output; more get "
            "RESOURCE_EXHAUSTED with a retry delay (0: no cap)",
            Group.GATEWAY,
            accepts=NO_CAP_OR_MORE,
        ),
    ] = 1 << 22
    stream_interval: Annotated[
        int,
        Flag(
            "a streaming call gets its first message at once, then one per this many output "
            "tokens (and the last); more than 1 sends fewer, larger messages: less work per "
            "token for the gateway and the client, tokens in groups",
            Group.GATEWAY,
            accepts=AT_LEAST_1,
        ),
    ] = 1
    stream_messages_per_s: Annotated[
        float,
        Flag(
            "streamed messages a second one gateway aims to send at most, all calls together: "
            "while more calls stream than that allows at one message per engine step, each "
            "waits 1/(this / calls) seconds between messages and sends the steps that came "
            "meanwhile as one (the same tokens and text in fewer messages; a call's first "
            "message and a finished step are never held); 0: one message per step whatever "
            "the load",
            Group.GATEWAY,
            metavar="N",
            accepts=AT_LEAST_0,
        ),
    ] = 1000.0
    tokenizer_threads: int = 2
    max_message_bytes: int = 64 * 1024 * 1024
    startup_timeout_s: float = 600.0
    # Observability: OTLP traces, /metrics and the periodic stats log line.
    otlp_traces_endpoint: Annotated[
        str,  # "" = OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, or no tracing
        Flag(
            "export request traces over OTLP to this collector, e.g. http://jaeger:4317 "
            "(default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset = no tracing)",
            Group.OBSERVABILITY,
        ),
    ] = ""
    otlp_traces_protocol: Annotated[
        str,
        Flag(
            "OTLP protocol (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc)",
            Group.OBSERVABILITY,
            choices=("grpc", "http/protobuf"),
        ),
    ] = ""
    trace_content: Annotated[
        bool,
        Flag(
            "put prompt and output text in span attributes (they may be sensitive)",
            Group.OBSERVABILITY,
        ),
    ] = False
    metrics_port: Annotated[
        int | None,  # on this port + client_index
        Flag(
            "serve Prometheus /metrics on this port (gateway i of one machine: port + i) "
            "(default: no /metrics)",
            Group.OBSERVABILITY,
        ),
    ] = None
    stall_warn_s: Annotated[
        float,  # 0 = off
        Flag(
            "count (switchboard:request_stalls_total) and log a stream that has started and then "
            "got no token for this many seconds while its engine is alive (0: off)",
            Group.OBSERVABILITY,
            metavar="S",
            accepts=AT_LEAST_0,
        ),
    ] = DEFAULT_STALL_WARN_S
    log_stats_interval_s: Annotated[
        float,  # 0 = off
        Flag(
            "drop the gateway's throughput and queue log line (every 10 s)",
            Group.OBSERVABILITY,
            name="--disable-log-stats",
            switch=True,
            to_config=_log_stats_off,
        ),
    ] = 10.0
    # TLS on both fronts and /metrics (tls.py): certificate chain and key; with a CA bundle,
    # client certificates are required and verified (mTLS). "" = plaintext.
    ssl_certfile: Annotated[
        str,
        Flag(
            "serve gRPC, HTTP and /metrics over TLS with this PEM certificate chain (read once "
            "at start) (default: plaintext)",
            Group.SECURITY,
            metavar="FILE",
            path=True,
        ),
    ] = ""
    ssl_keyfile: Annotated[
        str,
        Flag(
            "the certificate's PEM private key (default: none; needed with --ssl-certfile)",
            Group.SECURITY,
            metavar="FILE",
            path=True,
        ),
    ] = ""
    ssl_ca_certs: Annotated[
        str,
        Flag(
            "PEM CA bundle: clients must present a certificate it signed (mTLS) "
            "(default: no client certificates asked for)",
            Group.SECURITY,
            metavar="FILE",
            path=True,
        ),
    ] = ""
    # API keys (gateway/auth.py), one per line; the keys themselves never travel in a config
    # (configs are on children's command lines): given on the command line they reach the
    # gateway in $SWITCHBOARD_API_KEYS, the admin token in $SWITCHBOARD_ADMIN_TOKEN.
    api_key_file: Annotated[
        str,
        Flag(
            "API keys, one per line (with --api-key: both count) (default: none)",
            Group.SECURITY,
            metavar="FILE",
            path=True,
        ),
    ] = ""
    metrics_token_file: Annotated[
        str,
        Flag(
            "the bearer token /metrics asks for, read from this file (instead of --metrics-token) "
            "(default: none)",
            Group.SECURITY,
            metavar="FILE",
            path=True,
        ),
    ] = ""


class GatewayRoleConfig(Config, frozen=True):
    """Everything one gateway process needs."""

    model: ModelConfig
    gateway: GatewayConfig = GatewayConfig()
    client_index: Annotated[
        int,  # `switchboard gateway` without the flag: a random one (cli/role_commands.py)
        Flag(
            "this gateway's index on the engines' wire (default: random, unique in practice)",
            Group.ENGINES_ELSEWHERE,
            default=None,
            accepts=AT_LEAST_0,
        ),
    ] = 0
    input_address: str = ""  # ROUTER bind address
    output_address: str = ""  # PULL bind address
    num_engines: int = 1
    exit_when_engines_dead: bool = True  # one machine: the gateway exits with its engine
    # One machine with --restart-policy always: the supervisor restarts a dead engine, so the
    # gateway waits for its READY instead of exiting when its last engine dies; and a request
    # that reaches a restarted gateway before its engines' READY waits for them.
    engines_restart: bool = False
    # A stream cut off by an engine's death is re-submitted (prompt + the tokens already sent)
    # to a live or restarted engine within resume_timeout_s; 0 = never (UNAVAILABLE at once,
    # as with --no-resume).
    resume_timeout_s: Annotated[
        float,
        Flag(
            "how long a cut-off stream waits for an engine to resume on",
            Group.FAILURES,
            default=60.0,
            accepts=AT_LEAST_0,
        ),
    ] = 0.0
    shutdown_grace_s: Annotated[
        float,
        Flag(
            "SIGTERM: readiness NOT_SERVING at once, in-flight streams get this many seconds "
            "to finish, then everything stops",
            Group.FAILURES,
            name="--shutdown-grace",
            accepts=AT_LEAST_0,
        ),
    ] = DEFAULT_SHUTDOWN_GRACE_S
    heartbeat_timeout_s: Annotated[
        float,
        Flag(
            "an engine silent this long (no output, no heartbeat) is dead",
            Group.ENGINES_ELSEWHERE,
            name="--engine-heartbeat-timeout",
            metavar="S",
            accepts=POSITIVE,
        ),
    ] = 10.0
    # Topologies beyond one engine on one machine: DP > 1 (coordinator), engines on other hosts.
    coordinator_publish_address: str = ""  # the coordinator's PUB of LoadReport ("" = none)
    # Engines on other hosts: the fixed TCP address engines say hello to ("" = one machine).
    # The data sockets then bind on port 0 of the same host and are announced in the answer.
    handshake_address: str = ""
    curve_keys_dir: Annotated[str, curve_keys_flag(Group.ENGINES_ELSEWHERE)] = ""
