"""The committed stubs in services/switchboard/api/v1 are what scripts/gen_proto.py makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "services/switchboard/api/v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _stubs(directory: Path) -> dict[str, str]:
    return {
        p.name: p.read_text() for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES)
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts/gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh, committed = _stubs(tmp_path), _stubs(COMMITTED)
    assert fresh, "gen_proto.py generated nothing"
    assert sorted(committed) == sorted(fresh), "stub files differ: run scripts/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run scripts/gen_proto.py"


def test_stubs_import_as_package_modules() -> None:
    from switchboard.api.v1 import generation_service_pb2, generation_service_pb2_grpc

    assert generation_service_pb2.DESCRIPTOR.package == "switchboard.v1"
    assert hasattr(generation_service_pb2_grpc, "GenerationServiceServicer")
