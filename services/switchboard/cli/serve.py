"""`switchboard serve`, and what `gateway` and `engine` share with it: their flags (declared on
the configs, and on ``ServeFlags`` for those that set no config field), the checks run before
anything starts, and the configs built from the parsed flags."""

from __future__ import annotations

import argparse
import os
from typing import Annotated

import msgspec

from switchboard.cli.struct_flags import Layout, build
from switchboard.common.flags import AT_LEAST_0, POSITIVE, Flag, Group
from switchboard.config import (
    CacheConfig,
    EngineConfig,
    GatewayConfig,
    GatewayRoleConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from switchboard.config.lora import LoraConfig


class ServeFlags(msgspec.Struct, frozen=True, kw_only=True):
    """The flags that set no config field: the supervisor's restart policy, whether cut-off
    streams resume, and the gateway's secrets (they reach it in the environment, never in a
    config: configs are on children's command lines)."""

    restart_policy: Annotated[
        str,
        Flag(
            "serve: restart an engine core, gateway or coordinator that dies (backoff; each "
            "at most --max-restarts within --restart-window-s, then the whole server stops); "
            "never: any death stops the whole server",
            Group.FAILURES,
            choices=("always", "never"),
        ),
    ] = "always"
    max_restarts: Annotated[
        int, Flag("restarts per process per window", Group.FAILURES, accepts=AT_LEAST_0)
    ] = 5
    restart_window_s: Annotated[
        float, Flag("the restart window", Group.FAILURES, accepts=POSITIVE)
    ] = 300.0
    resume: Annotated[
        bool,  # off: the gateway's resume_timeout_s is 0
        Flag(
            "re-submit a stream cut off by an engine's death (prompt + the tokens sent) to a "
            "live or restarted engine (--no-resume: UNAVAILABLE at once)",
            Group.FAILURES,
        ),
    ] = True
    api_key: Annotated[
        list[str],
        Flag(
            "a key clients send as 'authorization: Bearer KEY' (gRPC metadata, HTTP header); "
            "repeat for more (default: no key needed; also $SWITCHBOARD_API_KEYS, one per line)",
            Group.SECURITY,
            metavar="KEY",
        ),
    ] = []
    admin_token: Annotated[
        str,
        Flag(
            "the bearer token AdminService asks for, instead of the API keys (default: "
            "$SWITCHBOARD_ADMIN_TOKEN; unset: AdminService is as open as the data plane)",
            Group.SECURITY,
            metavar="TOKEN",
        ),
    ] = ""
    metrics_token: Annotated[
        str,
        Flag(
            "the bearer token /metrics (--metrics-port) asks for: scrapers send "
            "'authorization: Bearer TOKEN', others get 401 (default: $SWITCHBOARD_METRICS_TOKEN; "
            "unset: /metrics is open to whoever reaches its port)",
            Group.SECURITY,
            metavar="TOKEN",
        ),
    ] = ""


# What serve, gateway and engine take (in this order within a --help section); the role
# commands add theirs (cli/role_commands.py).
SHARED_STRUCTS = (
    ModelConfig,
    LoraConfig,
    GatewayConfig,
    SchedulerConfig,
    CacheConfig,
    ParallelConfig,
    WorkerConfig,
    ServeFlags,
)
SHARED_SECTIONS = (
    Group.MODEL,
    Group.GATEWAY,
    Group.SCHEDULER,
    Group.PARALLEL,
    Group.FAILURES,
    Group.OBSERVABILITY,
)
# The gateway's own: only serve and gateway render chat messages and have fronts to secure.
FRONT_SECTIONS = (*SHARED_SECTIONS, Group.CHAT_TEMPLATE, Group.SECURITY)
SERVE = Layout(
    (*SHARED_STRUCTS, GatewayRoleConfig), FRONT_SECTIONS, frozenset({Group.CHAT_TEMPLATE})
)


def build_configs(
    args: argparse.Namespace, model_dir: str
) -> tuple[GatewayRoleConfig, EngineConfig]:
    """The gateway's and the engine's configs of serve, gateway or engine's flags, for the
    checkpoint in ``model_dir``."""
    model = build(ModelConfig, args, model=model_dir)
    parallel = build(ParallelConfig, args, api_servers=args.api_servers or args.data_parallel_size)
    engine = build(EngineConfig, args, model=model, parallel=parallel)
    never_resume = {} if build(ServeFlags, args).resume else {"resume_timeout_s": 0.0}
    gateway = build(
        GatewayRoleConfig,
        args,
        model=model,
        num_engines=parallel.data_parallel_size,
        **never_resume,
    )
    return gateway, engine


def resolve_model_arg(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The checkpoint directory for ``serve MODEL`` / ``--model``; a model found in the Hugging
    Face cache is served under its id unless ``--served-model-name`` says otherwise."""
    from switchboard.checkpoint import hub_model_id, resolve_model

    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        parser.error(f"two models given: {positional!r} and --model {args.model!r}")
    model = positional if positional is not None else args.model
    try:
        model_dir = resolve_model(model)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if not args.served_model_name:
        args.served_model_name = hub_model_id(model, model_dir) or ""
    return model_dir


def check_speculative_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model_dir: str | None = None
) -> None:
    """--speculative-config parses, before a model is resolved or converted; with the
    resolved ``model_dir``, a draft model fits it too (where it loads: not in a gateway)."""
    from switchboard.config.speculative import check_draft_model, parse_speculative_config

    try:
        config = parse_speculative_config(getattr(args, "speculative_config", "") or "")
        loads_models = getattr(args, "command", "serve") != "gateway"
        if config is not None and model_dir is not None and loads_models:
            check_draft_model(
                config,
                model_dir,
                getattr(args, "tensor_parallel_size", 1) or 1,
                getattr(args, "pipeline_parallel_size", 1) or 1,
                getattr(args, "max_model_len", None),
            )
    except ValueError as error:
        parser.error(str(error))


def check_chat_template(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: str
) -> None:
    """Fail now, not in the gateway child, on a missing or broken --chat-template file."""
    path = getattr(args, "chat_template", "")  # engine: no chat template
    if not path:
        return
    if not os.path.isfile(path):
        parser.error(f"--chat-template {path}: no such file")
    from switchboard.gateway.chat.template import ChatTemplateError, load_chat_template

    try:
        load_chat_template(model, path)
    except ChatTemplateError as error:
        parser.error(f"--chat-template {path}: {error}")


def apply_security_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the TLS files and keys now; hand the keys given on the command line to the
    gateway through the environment (configs travel on children's command lines)."""
    if not hasattr(args, "api_key"):
        return  # engine: no front
    from switchboard.common.tls import check_tls_files
    from switchboard.config import ADMIN_TOKEN_ENV, API_KEYS_ENV, METRICS_TOKEN_ENV
    from switchboard.gateway.auth import Credentials, parse_keys

    files = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "api_key_file", "metrics_token_file")
    for flag in files:
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            parser.error(f"--{flag.replace('_', '-')} {path}: no such file")
    gateway = build(GatewayConfig, args)
    try:
        check_tls_files(gateway)
    except (ValueError, OSError) as error:  # ssl.SSLError is an OSError
        parser.error(f"TLS: {error}")
    keys = [key.strip() for key in args.api_key if key.strip()]
    if len(keys) != len(args.api_key):
        parser.error("--api-key must not be empty")
    if keys:
        os.environ[API_KEYS_ENV] = "\n".join([*parse_keys(os.environ.get(API_KEYS_ENV, "")), *keys])
    if args.admin_token:
        os.environ[ADMIN_TOKEN_ENV] = args.admin_token.strip()
    if args.metrics_token or args.metrics_token_file:
        if args.metrics_token and args.metrics_token_file:
            parser.error("--metrics-token and --metrics-token-file: give one")
        if gateway.metrics_port is None:
            parser.error("--metrics-token/--metrics-token-file need --metrics-port")
        if args.metrics_token:
            if not args.metrics_token.strip():
                parser.error("--metrics-token must not be empty")
            os.environ[METRICS_TOKEN_ENV] = args.metrics_token.strip()
    try:
        credentials = Credentials.load(gateway)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if credentials.admin_token and credentials.admin_token in credentials.api_keys:
        parser.error("--admin-token must differ from every API key")


def check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--lora-modules entries are NAME=DIRECTORY, with --enable-lora, and no larger limits
    than they can hold; each directory exists (the workers check the rest at start)."""
    from switchboard.config.lora import parse_lora_modules

    try:
        modules = parse_lora_modules(args.lora_modules or [])
    except ValueError as error:
        parser.error(str(error))
    if modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    for name, path in modules.items():
        if not os.path.isdir(path):
            parser.error(f"--lora-modules {name}={path}: no such directory")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        parser.error("--max-cpu-loras must be at least --max-loras")


def prepare(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[GatewayRoleConfig, EngineConfig]:
    """The configs of serve, gateway or engine, after every check that can fail before
    anything starts."""
    check_speculative_config(parser, args)
    model_dir = resolve_model_arg(parser, args)
    check_speculative_config(parser, args, model_dir)
    check_chat_template(parser, args, model_dir)
    check_lora_args(parser, args)
    apply_security_args(parser, args)
    gateway, engine = build_configs(args, model_dir)
    check_kv_events(parser, engine)
    check_gateway_ports(parser, gateway, engine)
    return gateway, engine


def gateway_port_clash(gateway: GatewayRoleConfig, gateways: int) -> str | None:
    """Why the gateways' ports would collide, or None: gateway i serves HTTP on --http-port + i
    and metrics on --metrics-port + i beside the one gRPC port they share, so with two gateways
    --http-port 8000 --metrics-port 8001 gives gateway 1's HTTP port to gateway 0's metrics."""
    cfg = gateway.gateway
    ranges = [("--port", cfg.port, 1)]
    ranges += [("--http-port", cfg.http_port, gateways)] if cfg.http_port else []
    ranges += [("--metrics-port", cfg.metrics_port, gateways)] if cfg.metrics_port else []
    for i, (name, start, count) in enumerate(ranges):
        for other, other_start, other_count in ranges[i + 1 :]:
            if start < other_start + other_count and other_start < start + count:
                return (
                    f"{name} {start} and {other} {other_start} overlap: gateway i serves HTTP "
                    f"on --http-port + i and metrics on --metrics-port + i, so with {gateways} "
                    f"gateway(s) they need {gateways} ports each, apart from --port"
                )
    return None


def check_gateway_ports(
    parser: argparse.ArgumentParser, gateway: GatewayRoleConfig, engine: EngineConfig
) -> None:
    """Refuse ports that two of the gateways' servers would both bind (before anything starts:
    otherwise one gateway fails to start after the engines have loaded the model)."""
    clash = gateway_port_clash(gateway, engine.parallel.api_servers)
    if clash:
        parser.error(clash)


def check_kv_events(parser: argparse.ArgumentParser, engine: EngineConfig) -> None:
    """Refuse KV-event endpoints that two DP ranks would share."""
    events = engine.cache.kv_events_config
    clash = events.port_clash(engine.parallel.data_parallel_size) if events else None
    if clash:
        parser.error(f"--kv-events-config: {clash}")


def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from switchboard.supervisor.launcher import RestartPolicy, serve

    gateway, engine = prepare(parser, args)
    flags = build(ServeFlags, args)
    restarts = RestartPolicy(flags.restart_policy, flags.max_restarts, flags.restart_window_s)
    return serve(gateway, engine, restart=restarts)
