"""Sizing and the process-title formula of docs/architecture.md (no processes started here)."""

import pytest

from switchboard.cli import main
from switchboard.supervisor.processes import Topology


@pytest.mark.parametrize(
    ("a", "dp", "pp", "tp", "total"),
    [(1, 1, 1, 1, 3), (1, 1, 1, 2, 4), (2, 2, 1, 1, 7), (4, 4, 1, 2, 17)],
)
def test_formula(a: int, dp: int, pp: int, tp: int, total: int) -> None:
    topo = Topology(api_servers=a, data_parallel=dp, pipeline_parallel=pp, tensor_parallel=tp)
    assert topo.total == total
    assert len(topo.titles()) == total
    assert len(set(topo.titles())) == total  # titles are unique
    assert topo.min_vcpus == 2 * total
    assert all(t.startswith("switchboard::") for t in topo.titles())


def test_titles_for_single_device() -> None:
    topo = Topology(api_servers=1, data_parallel=1, pipeline_parallel=1, tensor_parallel=1)
    assert topo.titles() == [
        "switchboard::Gateway_0",
        "switchboard::EngineCore_DP0",
        "switchboard::Worker_DP0_PP0_TP0",
    ]


def test_topology_command_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", "-tp", "2", "-dp", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[-2].startswith("total processes") and lines[-2].split()[-1] == "17"
    # One physical core per process, two vCPUs per core (as the seed's sizing program).
    assert lines[-1].startswith("minimum vCPUs") and lines[-1].split()[-1] == "34"
    assert main(["topology", "-tp", "2", "-dp", "4", "--api-servers", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "28"
