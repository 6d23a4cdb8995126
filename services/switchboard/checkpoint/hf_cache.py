"""Find a Hugging Face model id (``org/name``) in the local Hugging Face cache; never download.

The cache is the one ``huggingface_hub`` writes (``hf download``, ``transformers``): the first
of $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE (its older name), $HF_HOME/hub,
$XDG_CACHE_HOME/huggingface/hub and ~/.cache/huggingface/hub. A model ``org/name`` lives in

    <cache>/models--org--name/refs/main            the commit hash of the main branch
    <cache>/models--org--name/snapshots/<hash>/    the files (links into ../../blobs)

The snapshot ``refs/main`` names is served when it holds a config.json; without refs/main (a
download of a pinned revision) the only snapshot with a config.json, or the newest of several.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# What the Hub accepts as a repository id: "name" or "org/name", letters, digits, - _ .
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def hub_cache_dir() -> tuple[Path, str]:
    """The Hugging Face hub cache folder and what chose it (an environment variable, or
    "default")."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser(), f"${variable}"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub", "$HF_HOME/hub"
    if os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]).expanduser()
        return base / "huggingface" / "hub", "$XDG_CACHE_HOME/huggingface/hub"
    return Path.home() / ".cache" / "huggingface" / "hub", "the default"


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model


def find_in_hub_cache(repo_id: str) -> Path | None:
    """The snapshot directory of ``repo_id`` in the hub cache, or None when the cache has no
    usable snapshot of it (see ``not_found_message``)."""
    repo = hub_cache_dir()[0] / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if commit and (snapshots / commit / "config.json").is_file():
            return snapshots / commit
        log.warning("%s names snapshot %s, which has no config.json", ref, commit)
    try:
        candidates = [d for d in snapshots.iterdir() if (d / "config.json").is_file()]
    except OSError:
        return None
    if not candidates:
        return None
    newest = max(candidates, key=lambda d: d.stat().st_mtime)
    if len(candidates) > 1:
        log.info("%s: %d snapshots and no refs/main; serving the newest, %s",
                 repo_id, len(candidates), newest.name)  # fmt: skip
    return newest


def not_found_message(repo_id: str) -> str:
    cache, chosen_by = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    return (
        f"model {repo_id!r} is not a local checkpoint directory or .gguf file, and the Hugging "
        f"Face cache has no snapshot of it with a config.json: looked in {repo}/snapshots/ "
        f"(cache {cache}, from {chosen_by}; set HF_HUB_CACHE or HF_HOME to look elsewhere). "
        f"switchboard never downloads models: fetch it first, e.g. `hf download {repo_id}` "
        f"(pip install huggingface_hub), or pass a checkpoint directory"
    )
