"""What the end-to-end tests send to a running server: Generate requests, admin utilities, and
scrapes of the Prometheus endpoint."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from switchboard.api.v1 import admin_service_pb2 as admin_pb
from switchboard.api.v1 import admin_service_pb2_grpc as admin_grpc
from switchboard.api.v1 import generation_service_pb2 as pb

UTILITY_TIMEOUT_S = 120.0  # generous: other tests share the two cores


def greedy_request(
    prompt: list[int] | str,
    max_tokens: int,
    *,
    final_only: bool = False,
    return_token_ids: bool = False,
    **fields: Any,
) -> pb.GenerateRequest:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored). ``prompt``: token ids or
    text; ``fields``: other GenerateRequest fields (request_id, priority, data_parallel_rank;
    None leaves an optional one unset)."""
    if isinstance(prompt, str):
        request = pb.GenerateRequest(text=prompt, **fields)
    else:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), **fields)
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    if final_only:
        request.output.kind = pb.OUTPUT_KIND_FINAL_ONLY
    if return_token_ids:
        request.output.return_token_ids = True
    return request


def streamed_token_ids(responses: Iterable[pb.GenerateResponse]) -> list[int]:
    """Every sequence's token ids, in the order the responses carried them."""
    return [t for r in responses for o in r.outputs for t in o.token_ids]


def utility(
    channel: grpc.Channel, method: str, *args: Any, timeout_s: float = UTILITY_TIMEOUT_S
) -> Any:
    """AdminService.Utility on the one engine; its result as plain values (None if it has none)."""
    request = admin_pb.UtilityRequest(method=method)
    request.args.extend(args)
    stub = admin_grpc.AdminServiceStub(channel)
    (result,) = stub.Utility(request, timeout=timeout_s).results
    assert result.status.code == 0, result.status.message
    return json_format.MessageToDict(result.result) if result.HasField("result") else None


def scrape(port: int, token: str = "") -> dict[tuple[str, frozenset], float]:
    """One scrape of ``/metrics`` (with the metrics ``token`` if given): (sample name, labels)
    -> value."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_sum(scraped: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The sum over every series of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, series), v in scraped.items() if n == name and wanted <= series)
