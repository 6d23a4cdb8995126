"""proto/ is self-contained for other languages: every non-well-known import of the API's protos
is vendored under proto/google/, unchanged from googleapis-common-protos (whose Python modules
are what Python uses at run time)."""

from __future__ import annotations

import re
from pathlib import Path

import google.rpc.status_pb2

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto"
INSTALLED = Path(google.rpc.status_pb2.__file__).parents[2]  # site-packages: google/rpc/*.proto
_IMPORT = re.compile(r'^import\s+(?:public\s+)?"([^"]+)";', re.MULTILINE)


def _imports(path: Path) -> set[str]:
    return set(_IMPORT.findall(path.read_text()))


def test_every_import_is_in_proto_or_a_well_known_type() -> None:
    missing = sorted(
        f"{path.relative_to(PROTO)} imports {name}"
        for path in PROTO.rglob("*.proto")
        for name in _imports(path)
        if not name.startswith("google/protobuf/") and not (PROTO / name).is_file()
    )
    assert missing == []


def test_vendored_copies_match_googleapis_common_protos() -> None:
    vendored = sorted((PROTO / "google").rglob("*.proto"))
    assert {p.name for p in vendored} >= {"status.proto", "error_details.proto"}
    for path in vendored:
        text = path.read_text()
        assert text.startswith("// Copyright") and "Apache License" in text[:600], path
        assert text == (INSTALLED / path.relative_to(PROTO)).read_text(), path
    assert (PROTO / "google" / "LICENSE").is_file()
