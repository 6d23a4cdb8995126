"""What a panel matmul module (the float32, bfloat16 and quantized small-batch kernels) knows
once it has loaded its kernel: the pack and linear functions in use, the rows one call takes,
the variant and a status line. Each module holds one :class:`PanelKernel` and answers its
``status()``, ``unload()``, ``packable()``, ``max_rows()`` and ``variant()`` from it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from switchboard.kernels import library

NOT_LOADED = "not loaded"


def runnable_variants(
    variants: Mapping[str, tuple[int, Collection[str]]], compiled: int, flags: Collection[str]
) -> list[str]:
    """The names in ``variants`` (name -> (the C side's number, the CPU flags it needs)) that
    are compiled (bit ``number`` of ``compiled``) and whose flags the CPU has, in their order."""
    return [
        name
        for name, (number, needs) in variants.items()
        if compiled & (1 << number) and all(flag in flags for flag in needs)
    ]


class PanelKernel:
    """One panel matmul kernel's load state; ``dtype`` is the weights' that ``packable`` takes."""

    def __init__(self, module: str, dtype: torch.dtype | None = None) -> None:
        self.module = module  # its module's ``__name__``
        self.dtype = dtype
        self.status = NOT_LOADED
        self.max_rows = 0  # rows one call takes over each cached panel; 0 while not loaded
        self.variant = ""
        self._pack: Callable[..., Any] | None = None
        self._linear: Callable[..., Any] | None = None

    @property
    def loaded(self) -> bool:
        return self._linear is not None

    def use(
        self,
        pack: Callable[..., Any],
        linear: Callable[..., Any],
        rows: int,
        variant: str,
        status: str,
    ) -> None:
        self._pack, self._linear, self.max_rows = pack, linear, rows
        self.variant, self.status = variant, status

    def unload(self, status: str = NOT_LOADED) -> None:
        self._pack = self._linear = None
        self.max_rows, self.variant, self.status = 0, "", status

    def load_fixed(
        self, variable: str, pack: str, linear: str, max_rows: str, variant: str = ""
    ) -> bool:
        """Load a kernel without variants (``library.load_panel_kernel``'s checks); True when
        it is in use, else ``status`` says why not."""
        functions, rows, status = library.load_panel_kernel(variable, pack, linear, max_rows)
        if functions is None:
            self.status = status
            return False
        pack_function, linear_function = functions
        self.use(pack_function, linear_function, rows, variant, status)
        return True

    def select(
        self,
        select: Callable[[int], int],
        pack: Callable[..., Any],
        linear: Callable[..., Any],
        number: int,
        variant: str,
        status: str,
    ) -> int:
        """Switch the library to variant ``number`` (``select``, the C side's) and use ``pack``
        and ``linear``; the rows a call takes (0: not compiled, and nothing changed).
        ``status`` is formatted with ``rows``."""
        rows = int(select(number))
        if rows:
            self.use(pack, linear, rows, variant, status.format(rows=rows))
        return rows

    def packable(self, weight: torch.Tensor) -> bool:
        """Whether the kernel is loaded and ``weight`` is a dense CPU matrix of its dtype."""
        return (
            self._pack is not None
            and weight.dim() == 2
            and weight.layout == torch.strided
            and weight.dtype == self.dtype
            and weight.device.type == "cpu"
        )

    def pack_function(self, why: str) -> Callable[..., Any]:
        """The pack function in use; ``ValueError(why)`` while not loaded."""
        if self._pack is None:
            raise ValueError(why)
        return self._pack

    def linear_function(self) -> Callable[..., Any]:
        short = self.module.rpartition(".")[2]
        assert self._linear is not None, f"{short}.linear before load()"
        return self._linear
