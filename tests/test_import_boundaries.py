"""The house rules on imports: process roles never import one another, and only
``worker/``, ``models/`` and ``kernels/`` import torch, so the gateway and the engine core start
(and test) without it. The wires own their codecs: no role builds a msgpack or JSON codec of its
own. ``kernels/`` is below ``models/``, and neither has an import circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "services" / "switchboard"
ROLES = ("gateway", "engine", "worker", "coordinator")
TORCH_ALLOWED = ("worker", "models", "kernels")


def _imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from a import b
    return names


def _top_folder(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else ""


def _sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if _top_folder(p) != "api"]


def test_process_roles_never_import_one_another() -> None:
    breaches = []
    for path in _sources():
        role = _top_folder(path)
        if role not in ROLES:
            continue
        for module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] == "switchboard" and len(parts) > 1:
                if parts[1] in ROLES and parts[1] != role:
                    breaches.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert breaches == []


def test_only_workers_models_and_kernels_import_torch() -> None:
    breaches = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in _sources()
        if _top_folder(path) not in TORCH_ALLOWED
        for module in _imported_modules(path)
        if module.split(".")[0] == "torch"
    ]
    assert breaches == []


def test_kernels_know_no_model_and_no_process_role() -> None:
    """``kernels/`` is below ``models/``: the models hand it tensors, it imports none of theirs."""
    allowed = ("switchboard.kernels", "switchboard.config")
    breaches = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in (PACKAGE / "kernels").glob("*.py")
        for module in _switchboard_imports(path)
        if module != "switchboard" and not module.startswith(allowed)
    ]
    assert breaches == []


def test_models_and_kernels_import_in_no_circle() -> None:
    """No module of ``models/`` or ``kernels/`` reaches itself through its imports (lazy ones
    included)."""
    modules = {
        "switchboard." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p
        for folder in ("models", "kernels")
        for p in (PACKAGE / folder).glob("*.py")
        if p.name != "__init__.py"
    }
    edges = {
        name: {m for m in _imported_modules(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    circles = []
    for start in sorted(modules):
        seen, frontier = set(), set(edges[start])
        while frontier:
            name = frontier.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                frontier |= edges[name]
    assert circles == []


def test_roles_use_the_wires_codecs() -> None:
    """``msgspec.msgpack`` and ``msgspec.json`` appear only in ``wire/`` (``wire/codec.py``):
    a role encodes and decodes wire messages with the codecs there."""
    breaches = []
    for path in _sources():
        if _top_folder(path) not in ROLES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: set[str] = set()
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names.add(f"{node.value.id}.{node.attr}")  # msgspec.msgpack.Decoder(...)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(a.name for a in node.names)  # import msgspec.msgpack
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)  # from msgspec.msgpack import Decoder
                    names.update(f"{node.module}.{a.name}" for a in node.names)
            for name in sorted(names & {"msgspec.msgpack", "msgspec.json"}):
                breaches.append(f"{path.relative_to(PACKAGE)}:{node.lineno} uses {name}")
    assert breaches == []


def test_gateway_and_engine_load_without_torch() -> None:
    """Indirect imports count too: load every module of the torch-free roles in a fresh
    interpreter and look at what came along."""
    modules = sorted(
        "switchboard." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
        for p in _sources()
        if _top_folder(p) in ("gateway", "engine", "coordinator", "wire", "checkpoint")
        or (_top_folder(p) == "" and p.name != "__init__.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith(('switchboard.worker', 'switchboard.models', 'switchboard.kernels'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _gateway_files(group: str) -> list[Path]:
    return sorted((PACKAGE / "gateway" / group).glob("*.py"))


def _switchboard_imports(path: Path) -> set[str]:
    return {m for m in _imported_modules(path) if m.split(".")[0] == "switchboard"}


def test_the_gateways_engine_side_imports_only_errors_and_wire() -> None:
    """``gateway/engines/`` is the wire-1 client: it knows messages and API errors, nothing of
    requests' validation, streams or observability (a rate limit on its warnings aside)."""
    allowed = (
        "switchboard.wire",
        "switchboard.gateway.engines",
        "switchboard.gateway.api_errors",
        "switchboard.common.log_limits",
    )
    breaches = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in _gateway_files("engines")
        for module in _switchboard_imports(path)
        if module != "switchboard" and not module.startswith(allowed)
    ]
    assert _gateway_files("engines") and breaches == []


def test_only_the_server_imports_the_servicers() -> None:
    breaches = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for group in ("engines", "observability", "pipeline")
        for path in _gateway_files(group)
        for module in _switchboard_imports(path)
        if module.startswith("switchboard.gateway.servicers")
    ]
    assert breaches == []
