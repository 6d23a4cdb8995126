"""vLLM's GenerateRequest -> switchboard.v1's (the shape only: the pipeline's rules are tested
through a real server in tests/e2e/test_vllm_engine_service.py), and who may call the service."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError, invalid_argument
from switchboard.gateway.auth import Credentials
from switchboard.gateway.servicers.vllm_engine.request import renamed, to_generate_request


def test_proto3_zeros_stay_unset_and_the_rest_is_carried() -> None:
    request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3], original_text="ignored"),
        sampling_params=vpb.SamplingParams(
            temperature=0.5, max_tokens=9, stop=["x"], seed=4, truncate_prompt_tokens=-1
        ),
        stream=True,
        data_parallel_rank=1,
    )
    out = to_generate_request(request, "r", max_model_len=128)
    for field in ("top_p", "top_k", "min_p", "repetition_penalty", "n"):
        assert not out.sampling.HasField(field), field
    assert out.sampling.temperature == 0.5 and out.sampling.seed == 4
    assert out.stopping.max_tokens == 9 and list(out.stopping.stop) == ["x"]
    assert list(out.token_ids.ids) == [1, 2, 3] and out.data_parallel_rank == 1
    assert out.truncate_prompt_tokens == 128  # vLLM's -1: the model's length
    assert out.output.kind == pb.OUTPUT_KIND_DELTA and out.output.return_token_ids
    assert out.output.detokenize  # stop strings are matched in text
    unary = to_generate_request(vpb.GenerateRequest(text="hi"), "r", max_model_len=128)
    assert unary.output.kind == pb.OUTPUT_KIND_FINAL_ONLY and not unary.output.detokenize


@pytest.mark.parametrize(
    "field",
    ["media_refs", "kv_transfer_params", "kv_transfer_params_json", "extra_mm_inputs"],
)
def test_what_cannot_be_honoured_is_refused_by_name(field: str) -> None:
    request = vpb.GenerateRequest(text="hi")
    if field == "kv_transfer_params_json":
        request.kv_transfer_params_json = "{}"
    elif field == "extra_mm_inputs":
        request.extra_mm_inputs.add()
    else:
        getattr(request, field).SetInParent()
    with pytest.raises(ApiError) as caught:
        to_generate_request(request, "r", max_model_len=128)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == field and field in caught.value.message


def test_pipeline_errors_name_vllm_fields() -> None:
    error = renamed(invalid_argument("stopping.max_tokens", "stopping.max_tokens: too many"))
    assert (error.field, error.message) == (
        "sampling_params.max_tokens",
        "sampling_params.max_tokens: too many",
    )
    error = renamed(invalid_argument("token_ids.ids[3]", "token_ids.ids[3] = 9 is out of range"))
    assert error.message == "tokenized.input_ids[3] = 9 is out of range"


def test_generation_is_data_plane_and_cache_flushes_are_admin() -> None:
    credentials = Credentials(api_keys=("key",), admin_token="admin")
    key = [("authorization", "Bearer key")]
    admin = [("authorization", "Bearer admin")]
    service = "/vllm.grpc.engine.VllmEngine/"
    assert credentials.check_method(service + "Generate", key) is None
    assert credentials.check_method(service + "Generate", []) is not None
    assert credentials.check_method(service + "FlushCache", key) is not None
    assert credentials.check_method(service + "FlushCache", admin) is None
