"""The `switchboard` command: serve | gateway | engine | coordinator | generate | chat | topology |
ps.

Flag names follow vLLM's where the concept is the same, so a vLLM user's command line works.
"""

# This module imports only the standard library at the top: the client commands (generate) run
# on the client install (grpcio + protobuf, `pip install switchboard`); the server commands
# import their modules when they run, and without the `server` extra they say how to get it.

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from switchboard.defaults import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT

if TYPE_CHECKING:
    from switchboard.config import EngineConfig, GatewayRoleConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SERVER_COMMANDS = {
    "serve": "start gateway, engine core and workers on this machine",
    "gateway": "run one gateway; engines on other hosts join it",
    "engine": "run one engine core and its workers for gateways",
    "coordinator": "run the coordinator for engines and gateways on other hosts (DP > 1)",
    "keys": "make the CURVE keys that authenticate gateways, engines and coordinator over TCP",
}
SERVER_INSTALL_HINT = "pip install 'switchboard[server]'"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: ``(default: X)`` from the parser, ``on`` or
    ``off`` for a switch, nothing where the text already says it (a default of None or "" means
    something only words can say) or the option is required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.required
            or not action.option_strings
            or action.default is argparse.SUPPRESS
        ):
            return text
        if action.nargs == 0 and isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def _add_parallel_sizes(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="workers per pipeline stage, each holding a slice of every layer",
    )
    group.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages per engine, each holding a run of consecutive layers",
    )
    group.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores, each with its own workers and KV cache",
    )


def _server_import_error() -> ImportError | None:
    """Why the server commands cannot run here (the client install lacks the ``server``
    extra), or None."""
    try:
        import switchboard.cli_roles  # noqa: F401  (msgspec, pyzmq)
        import switchboard.config  # noqa: F401
    except ImportError as exc:
        return exc
    return None


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from switchboard.config import (
        CPU_SHARED_STEP_TOKENS,
        DEFAULT_SHUTDOWN_GRACE_S,
        MAX_NUM_BATCHED_TOKENS,
        CacheConfig,
        GatewayConfig,
        SchedulerConfig,
        WorkerConfig,
    )

    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help="a Hugging Face checkpoint directory, a .gguf file, or a Hugging Face model id "
        "(org/name) already in the local Hugging Face cache (HF_HUB_CACHE, HF_HOME; never "
        "downloaded) (default: the built-in SmolLM2-135M-Instruct, converted on first use)",
    )
    m.add_argument(
        "--served-model-name",
        default="",
        help="the model's name in the API (ListModels, GenerateRequest.model) "
        "(default: the checkpoint directory's name)",
    )
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations; auto: float32 on CPU, the checkpoint's dtype on a GPU",
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens per request at most, prompt and output together (default: the model's "
        "positions, capped by what the KV cache holds)",
    )
    m.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workers' torch seed: the draws of requests that set no seed of their own",
    )

    g = p.add_argument_group("gateway")
    g.add_argument("--host", default="0.0.0.0", help="address the gRPC server binds on")
    g.add_argument("--port", type=int, default=DEFAULT_GRPC_PORT, help="the gRPC server's port")
    g.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="the OpenAI-compatible HTTP API's port (gateway i of one machine: port + i; "
        "0: a free port, logged; -1: no HTTP API)",
    )
    g.add_argument(
        "--api-servers",
        type=int,
        default=None,
        help="gateway processes sharing the port (default: DP)",
    )
    g.add_argument(
        "--enable-admin",
        action="store_true",
        help="serve AdminService (allow-listed engine utilities)",
    )
    g.add_argument(
        "--max-inflight-requests",
        type=int,
        default=GatewayConfig().max_inflight_requests,
        help="Generate calls one gateway process serves at once; more get RESOURCE_EXHAUSTED "
        "with a retry delay (0: no cap)",
    )
    g.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=GatewayConfig().max_queued_prompt_tokens,
        help="prompt tokens one gateway process holds waiting for their first output; more get "
        "RESOURCE_EXHAUSTED with a retry delay (0: no cap)",
    )

    g.add_argument(
        "--stream-interval",
        type=int,
        default=GatewayConfig().stream_interval,
        help="a streaming call gets its first message at once, then one per this many output "
        "tokens (and the last); more than 1 sends fewer, larger messages: less work per token "
        "for the gateway and the client, tokens in groups",
    )

    s = p.add_argument_group("scheduler and KV cache")
    s.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig().max_num_seqs,
        help="running requests at most",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=(
            "tokens per engine step; longer prompts are prefilled in chunks (default: "
            f"{MAX_NUM_BATCHED_TOKENS}; on CPU workers {CPU_SHARED_STEP_TOKENS} while more than "
            "one request is in the engine; at least --max-num-seqs)"
        ),
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=SchedulerConfig().long_prefill_token_threshold,
        help="one request's prefill chunk at most while others are eligible (0: no cap)",
    )
    s.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="priority: by GenerateRequest.priority (lower first), preempting the lowest",
    )
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=SchedulerConfig().async_scheduling,
        help=(
            "schedule the next step while the workers compute one, so the engine's turn "
            "between steps is off the critical path (--no-async-scheduling: one at a time)"
        ),
    )
    s.add_argument(
        "--block-size",
        type=int,
        default=CacheConfig().block_size,
        help="token slots per KV block (the prefix cache shares whole blocks)",
    )
    s.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV blocks per engine, instead of sizing them from memory (default: as many as "
        "the KV cache budget holds, see --kv-cache-memory-bytes)",
    )
    s.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache budget per worker (default: --gpu-memory-utilization; 1 GiB on CPU)",
    )
    s.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=CacheConfig().gpu_memory_utilization,
        help="share of the device memory left free after loading the weights, for the KV cache",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="automatic prefix caching (--no-enable-prefix-caching: off)",
    )

    w = p.add_argument_group("parallelism and workers")
    _add_parallel_sizes(w)
    w.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the workers run the model; auto: cuda when torch sees one, else cpu",
    )
    w.add_argument(
        "--torch-threads",
        type=int,
        default=WorkerConfig().torch_threads,
        help="torch intra-op threads per worker (default 0: the usable CPUs shared equally "
        "among the workers on this host)",
    )

    r = p.add_argument_group("failures and stopping (docs/operations.md, Failure)")
    r.add_argument(
        "--step-timeout-s",
        type=float,
        default=WorkerConfig().step_timeout_s,
        help="a worker that has not answered a step within this (plus "
        "--step-timeout-per-token-s per scheduled token) is stalled: logged by rank and pid, "
        "its engine takes no new requests until it answers",
    )
    r.add_argument(
        "--step-timeout-per-token-s",
        type=float,
        default=WorkerConfig().step_timeout_per_token_s,
        help="added to both step timeouts per token of the step (a long prefill is no stall)",
    )
    r.add_argument(
        "--execute-timeout-s",
        type=float,
        default=WorkerConfig().execute_timeout_s,
        help="the hard step timeout (plus the per-token term): past it the worker is treated "
        "as dead and its engine fails",
    )
    r.add_argument(
        "--restart-policy",
        choices=["always", "never"],
        default="always",
        help="serve: restart an engine core that dies (backoff; at most "
        "--max-restarts within --restart-window-s, then the whole server stops); never: a "
        "dead engine stops the whole server",
    )
    r.add_argument("--max-restarts", type=int, default=5, help="engine restarts per window")
    r.add_argument("--restart-window-s", type=float, default=300.0, help="the restart window")
    r.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-submit a stream cut off by an engine's death (prompt + the tokens sent) to a "
        "live or restarted engine (--no-resume: UNAVAILABLE at once)",
    )
    r.add_argument(
        "--resume-timeout-s",
        type=float,
        default=60.0,
        help="how long a cut-off stream waits for an engine to resume on",
    )
    r.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        help="SIGTERM: readiness NOT_SERVING at once, in-flight streams get this many seconds "
        "to finish, then everything stops",
    )

    o = p.add_argument_group("observability (docs/observability.md)")
    o.add_argument(
        "--otlp-traces-endpoint",
        default="",
        help="export request traces over OTLP to this collector, e.g. http://jaeger:4317 "
        "(default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset = no tracing)",
    )
    o.add_argument(
        "--otlp-traces-protocol",
        choices=["grpc", "http/protobuf"],
        default="",
        help="OTLP protocol (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc)",
    )
    o.add_argument(
        "--trace-content",
        action="store_true",
        help="put prompt and output text in span attributes (they may be sensitive)",
    )
    o.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (gateway i of one machine: port + i) "
        "(default: no /metrics)",
    )
    o.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="drop the gateway's throughput and queue log line (every 10 s)",
    )


def _add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    """serve and gateway only: the gateway renders chat messages, engines never see them."""
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template for GenerateRequest.messages, instead of the checkpoint's "
        "(default: the checkpoint's chat_template.jinja, else tokenizer_config.json's "
        "chat_template; a model with neither refuses messages)",
    )


def _add_security_args(p: argparse.ArgumentParser) -> None:
    """serve and gateway only: TLS and keys of the gateway's fronts (docs/operations.md
    "Security")."""
    t = p.add_argument_group("security (gRPC and HTTP fronts)")
    t.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        default="",
        help="serve gRPC and HTTP over TLS with this PEM certificate chain (read once at start) "
        "(default: plaintext)",
    )
    t.add_argument(
        "--ssl-keyfile",
        metavar="FILE",
        default="",
        help="the certificate's PEM private key (default: none; needed with --ssl-certfile)",
    )
    t.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        default="",
        help="PEM CA bundle: clients must present a certificate it signed (mTLS) "
        "(default: no client certificates asked for)",
    )
    t.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        default=[],
        help="a key clients send as 'authorization: Bearer KEY' (gRPC metadata, HTTP header); "
        "repeat for more (default: no key needed; also $SWITCHBOARD_API_KEYS, one per line)",
    )
    t.add_argument(
        "--api-key-file",
        metavar="FILE",
        default="",
        help="API keys, one per line (with --api-key: both count) (default: none)",
    )
    t.add_argument(
        "--admin-token",
        metavar="TOKEN",
        default="",
        help="the bearer token AdminService asks for, instead of the API keys (default: "
        "$SWITCHBOARD_ADMIN_TOKEN; unset: AdminService is as open as the data plane)",
    )


def _apply_security_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the TLS files and keys now; hand the keys given on the command line to the
    gateway through the environment (configs travel on children's command lines)."""
    if not hasattr(args, "api_key"):
        return  # engine: no front
    from switchboard.config import ADMIN_TOKEN_ENV, API_KEYS_ENV, GatewayConfig
    from switchboard.gateway.auth import Credentials, parse_keys
    from switchboard.tls import check_tls_files

    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "api_key_file"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            parser.error(f"--{flag.replace('_', '-')} {path}: no such file")
        setattr(args, flag, os.path.abspath(path) if path else "")
    gateway = GatewayConfig(
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        api_key_file=args.api_key_file,
    )
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
    try:
        credentials = Credentials.load(gateway)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if credentials.admin_token and credentials.admin_token in credentials.api_keys:
        parser.error("--admin-token must differ from every API key")


def build_configs(
    args: argparse.Namespace, model_dir: str
) -> tuple[GatewayRoleConfig, EngineConfig]:
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

    model = ModelConfig(
        model=model_dir,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        chat_template=os.path.abspath(args.chat_template) if _chat_template(args) else "",
    )
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        api_servers=args.api_servers or args.data_parallel_size,
    )
    engine = EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=args.block_size,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or 0,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=args.scheduling_policy,
            async_scheduling=args.async_scheduling,
        ),
        parallel=parallel,
        worker=WorkerConfig(
            device=args.device,
            torch_threads=args.torch_threads,
            step_timeout_s=args.step_timeout_s,
            step_timeout_per_token_s=args.step_timeout_per_token_s,
            execute_timeout_s=args.execute_timeout_s,
        ),
    )
    gateway = GatewayRoleConfig(
        model=model,
        gateway=GatewayConfig(
            host=args.host,
            port=args.port,
            enable_admin=args.enable_admin,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            otlp_traces_protocol=args.otlp_traces_protocol,
            trace_content=args.trace_content,
            metrics_port=args.metrics_port,
            http_port=None if args.http_port < 0 else args.http_port,
            log_stats_interval_s=0.0 if args.disable_log_stats else 10.0,
            stream_interval=args.stream_interval,
            max_inflight_requests=args.max_inflight_requests,
            max_queued_prompt_tokens=args.max_queued_prompt_tokens,
            ssl_certfile=getattr(args, "ssl_certfile", ""),
            ssl_keyfile=getattr(args, "ssl_keyfile", ""),
            ssl_ca_certs=getattr(args, "ssl_ca_certs", ""),
            api_key_file=getattr(args, "api_key_file", ""),
        ),
        num_engines=parallel.data_parallel_size,
        resume_timeout_s=args.resume_timeout_s if args.resume else 0.0,
        shutdown_grace_s=args.shutdown_grace,
    )
    return gateway, engine


def _chat_template(args: argparse.Namespace) -> str | None:
    return getattr(args, "chat_template", None)


def _check_chat_template(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str):
    """Fail now, not in the gateway child, on a missing or broken --chat-template file."""
    path = _chat_template(args)
    if not path:
        return
    if not os.path.isfile(path):
        parser.error(f"--chat-template {path}: no such file")
    from switchboard.gateway.chat.template import ChatTemplateError, load_chat_template

    try:
        load_chat_template(model, path)
    except ChatTemplateError as error:
        parser.error(f"--chat-template {path}: {error}")


def _validate_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = [
        "max_num_seqs",
        "max_num_batched_tokens",
        "stream_interval",
        "block_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "api_servers",  # these three may be unset (None)
        "max_model_len",
        "num_gpu_blocks_override",
        "kv_cache_memory_bytes",
    ]
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("max_inflight_requests", "max_queued_prompt_tokens"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0 (0: no cap)")
    for name in ("step_timeout_s", "execute_timeout_s", "restart_window_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("step_timeout_per_token_s", "resume_timeout_s", "shutdown_grace", "max_restarts"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0")
    if args.torch_threads < 0:
        parser.error("--torch-threads must be at least 0 (0: an equal share of the CPUs)")
    if args.long_prefill_token_threshold < 0:
        parser.error("--long-prefill-token-threshold must be at least 0 (0: no cap)")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    if not -1 <= args.http_port <= 65535:
        parser.error("--http-port must be a port, 0 (a free port) or -1 (no HTTP API)")
    if getattr(args, "data_parallel_rank", None) is not None and args.data_parallel_rank < 0:
        parser.error("--data-parallel-rank must be at least 0")


def _resolve_model_arg(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
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


def cmd_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from switchboard.launcher import RestartPolicy, serve

    _validate_serve_args(parser, args)
    model_dir = _resolve_model_arg(parser, args)
    _check_chat_template(parser, args, model_dir)
    _apply_security_args(parser, args)
    gateway, engine = build_configs(args, model_dir)
    restarts = RestartPolicy(args.restart_policy, args.max_restarts, args.restart_window_s)
    return serve(gateway, engine, restart=restarts)


def cmd_role(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`switchboard gateway` / `switchboard engine`: one role in this process."""
    from switchboard import cli_roles

    _validate_serve_args(parser, args)
    model_dir = _resolve_model_arg(parser, args)
    _check_chat_template(parser, args, model_dir)
    _apply_security_args(parser, args)
    gateway, engine = build_configs(args, model_dir)
    if args.command == "gateway":
        return cli_roles.cmd_gateway(args, gateway)
    return cli_roles.cmd_engine(args, engine)


def cmd_generate(args: argparse.Namespace) -> int:
    from switchboard.client import run_generate

    return run_generate(
        args.target,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )


def cmd_chat(args: argparse.Namespace) -> int:
    from switchboard.chat_client import run_chat

    return run_chat(
        args.target,
        args.message,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        system=args.system,
    )


def cmd_topology(args: argparse.Namespace) -> int:
    from switchboard.processes import Topology, format_topology

    topo = Topology(
        api_servers=args.api_servers or args.data_parallel_size,
        data_parallel=args.data_parallel_size,
        pipeline_parallel=args.pipeline_parallel_size,
        tensor_parallel=args.tensor_parallel_size,
    )
    print(format_topology(topo))
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from switchboard.processes import format_ps, list_processes

    print(format_ps(list_processes(args.pid)))
    return 0


def _add_client_args(
    parser: argparse.ArgumentParser, *, max_tokens: int, max_tokens_help: str
) -> None:
    """What the client commands (generate, chat) share: where the server is, how much to say."""
    parser.add_argument(
        "--target", default=f"127.0.0.1:{DEFAULT_GRPC_PORT}", help="the gateway's HOST:PORT"
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the model's generation_config.json, else 1.0)",
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchboard", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="this process's log level (under serve the children log at INFO; workers read "
        "$SWITCHBOARD_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)

    missing = _server_import_error()
    if missing is None:
        from switchboard import cli_roles

        serve = command("serve", SERVER_COMMANDS["serve"])
        serve.add_argument(
            "model_tag",
            nargs="?",
            default=None,
            metavar="MODEL",
            help="the model to serve, as vLLM's `vllm serve MODEL`: the same as --model",
        )
        _add_serve_args(serve)
        _add_chat_template_arg(serve)
        _add_security_args(serve)
        gateway = command("gateway", SERVER_COMMANDS["gateway"])
        _add_serve_args(gateway)
        _add_chat_template_arg(gateway)
        _add_security_args(gateway)
        cli_roles.add_gateway_args(gateway)
        engine = command("engine", SERVER_COMMANDS["engine"])
        _add_serve_args(engine)
        cli_roles.add_engine_args(engine)
        coordinator = command("coordinator", SERVER_COMMANDS["coordinator"])
        cli_roles.add_coordinator_args(coordinator)
        cli_roles.add_keys_args(command("keys", SERVER_COMMANDS["keys"]))
    else:  # the client install: the server commands only say how to get them
        for name, text in SERVER_COMMANDS.items():
            stub = command(name, f"{text} (needs the server: {SERVER_INSTALL_HINT})")
            stub.set_defaults(server_missing=missing)

    gen = command(
        "generate",
        "stream a raw completion of the prompt text from a running server (no chat template: "
        "to talk to an instruct model, use `switchboard chat`)",
    )
    gen.add_argument("prompt", help="the text to complete, sent as is")
    _add_client_args(gen, max_tokens=64, max_tokens_help="output tokens at most")

    chat = command(
        "chat",
        "chat with a running server's model through its chat template: interactive (history "
        "kept; Ctrl-C ends the answer, Ctrl-D leaves), or one question given on the command line",
    )
    chat.add_argument(
        "message",
        nargs="?",
        default=None,
        help="ask this, print the answer and exit (default: an interactive chat)",
    )
    _add_client_args(chat, max_tokens=512, max_tokens_help="tokens per answer at most")
    chat.add_argument(
        "--system",
        default=None,
        help="a system message opening the chat (default: none; the template may add its own)",
    )

    topo = command("topology", "print the process table of a topology")
    _add_parallel_sizes(topo)
    topo.add_argument(
        "--api-servers", type=int, default=None, help="gateway processes (default: DP)"
    )

    ps = command("ps", "list running switchboard processes")
    ps.add_argument(
        "--pid",
        type=int,
        default=None,
        help="only this process and its descendants (default: every switchboard process)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, unknown = parser.parse_known_args(argv)
    missing = getattr(args, "server_missing", None)
    if unknown and missing is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if missing is not None:  # a server command on the client install
        print(
            f"switchboard {args.command}: the server is not installed in this environment "
            f"({missing}); install it with {SERVER_INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    if args.command == "serve":
        return cmd_serve(parser, args)
    if args.command in ("gateway", "engine"):
        return cmd_role(parser, args)
    if args.command == "coordinator":
        from switchboard import cli_roles

        return cli_roles.cmd_coordinator(args)
    if args.command == "keys":
        from switchboard import cli_roles

        return cli_roles.cmd_keys(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "chat":
        return cmd_chat(args)
    if args.command == "topology":
        return cmd_topology(args)
    return cmd_ps(args)


if __name__ == "__main__":
    sys.exit(main())
