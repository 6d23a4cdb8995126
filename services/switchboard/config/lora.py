"""LoRA adapters served beside the base model: shared by the gateway (names, limits) and the
engine and workers (loading, slots)."""

from typing import Annotated

from switchboard.common.flags import AT_LEAST_1, Flag, Group
from switchboard.config.struct import Config


class LoraConfig(Config, frozen=True):
    enable_lora: Annotated[
        bool,
        Flag(
            "serve LoRA adapters (PEFT directories) beside the base model: a request names one "
            "as its model",
            Group.MODEL,
        ),
    ] = False
    lora_modules: Annotated[
        list[str],
        Flag(
            "adapters loaded at start, NAME=DIRECTORY each (a PEFT directory: "
            "adapter_config.json and adapter_model.safetensors); needs --enable-lora",
            Group.MODEL,
            metavar="NAME=DIR",
            many=True,
        ),
    ] = []
    max_loras: Annotated[
        int,
        Flag(
            "adapters resident at once: one engine step mixes at most this many (and the base "
            "model)",
            Group.MODEL,
            accepts=AT_LEAST_1,
        ),
    ] = 1
    max_lora_rank: Annotated[
        int,
        Flag("the highest adapter rank accepted", Group.MODEL, accepts=AT_LEAST_1),
    ] = 16
    max_cpu_loras: Annotated[
        int | None,
        Flag(
            "adapters kept checked in CPU memory, least recently used dropped first "
            "(default: --max-loras)",
            Group.MODEL,
            accepts=AT_LEAST_1,
        ),
    ] = None

    @property
    def cpu_loras(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


def parse_lora_modules(entries: list[str]) -> dict[str, str]:
    """``NAME=DIRECTORY`` entries -> {name: directory}; raises ValueError naming a bad one."""
    modules: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: expected NAME=DIRECTORY")
        if name in modules:
            raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
        modules[name] = path
    return modules
