"""A server started at import time from a spawned child fails loudly instead of multiplying."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from switchboard.supervisor.start_method import MissingMainGuard, require_main_process


def test_the_main_process_may_start_a_server() -> None:
    require_main_process()


def test_a_script_without_the_guard_fails_in_its_spawned_children(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing

            from switchboard.supervisor.start_method import require_main_process

            require_main_process()  # stands for serve(...): called at import time
            print("started a server", flush=True)

            if __name__ == "__main__":
                child = multiprocessing.get_context("spawn").Process(target=print)
                child.start()
                child.join(60)
                print("child exit code", child.exitcode, flush=True)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.count("started a server") == 1  # the child did not start another
    assert "child exit code 1" in result.stdout
    assert "MissingMainGuard" in result.stderr
    assert 'if __name__ == "__main__":' in result.stderr


def test_a_multiprocessing_child_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    class Child:
        name = "Process-1"

    monkeypatch.setattr(multiprocessing, "current_process", lambda: Child())
    with pytest.raises(MissingMainGuard, match="Process-1"):
        require_main_process()
