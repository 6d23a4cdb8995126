"""Building a kernel library: its sources compile one compiler each (at once where the process
has the cores) and link into one library whose functions call each other across them; it is
cached under its key, and a source that does not compile fails the build with the compiler's
message, naming the file, whatever the other sources did."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from switchboard.kernels import build
from switchboard.kernels.build import NativeBuildError, build_and_load

TWICE = "#include <stdint.h>\nint64_t twice(int64_t x) { return 2 * x; }\n"
CALLER = (
    "#include <stdint.h>\nint64_t twice(int64_t);\nint64_t quadruple(int64_t x) {\n"
    "    return twice(twice(x));\n}\n"
)


@pytest.fixture
def sources(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SWITCHBOARD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "csrc"
    folder.mkdir()
    (folder / "twice.c").write_text(TWICE)
    (folder / "caller.c").write_text(CALLER)
    return folder


def test_sources_link_into_one_cached_library(sources, monkeypatch):
    if build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(build, "_parallel_jobs", lambda count: count)  # both at once
    names = [sources / "caller.c", sources / "twice.c"]
    library = build_and_load("build_test", names, "build test", sources)
    library.quadruple.argtypes = [ctypes.c_int64]
    library.quadruple.restype = ctypes.c_int64
    assert library.quadruple(5) == 20
    built = list((sources.parent / "cache" / "kernels").glob("build_test_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    build_and_load("build_test", names, "build test", sources)  # the cached one
    assert built[0].stat().st_mtime_ns == stamp


def test_a_source_that_does_not_compile_fails_with_the_compilers_words(sources):
    if build.compiler() is None:
        pytest.skip("no C compiler")
    (sources / "broken.c").write_text("int broken(void) { return undeclared_name; }\n")
    names = [sources / "twice.c", sources / "broken.c", sources / "caller.c"]
    with pytest.raises(NativeBuildError, match=r"broken\.c.*undeclared_name"):
        build_and_load("build_test_broken", names, "build test", sources)
    assert not list((sources.parent / "cache" / "kernels").glob("build_test_broken_*.so"))


def test_as_many_compilers_as_the_cores_the_process_may_use(monkeypatch):
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert build._parallel_jobs(12) == 3
    assert build._parallel_jobs(2) == 2
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: set())
    assert build._parallel_jobs(12) == 1
