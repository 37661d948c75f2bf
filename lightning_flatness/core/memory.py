"""How many numbers of kept probe rows fit in memory: the probe kernel's guard for rows it keeps
(``KernelOptions.max_row_elements=None``), from the free memory of the device the rows live on
rather than a fixed count."""

from __future__ import annotations

import os

import torch

from lightning_flatness.core.curvature.row_sketch import RowSketch
from lightning_flatness.core.failures import StructureTooLargeError

__all__ = [
    "FALLBACK_ROW_ELEMENTS",
    "ROW_MEMORY_SHARE",
    "free_bytes",
    "row_element_limit",
    "row_elements",
    "rows_refusal",
]

#: the share of the free memory the kept rows may take (the rest: the model, the products'
#: blocks, the Lanczos basis, and whatever else the process holds)
ROW_MEMORY_SHARE = 0.4
#: the limit where the free memory cannot be read (2²⁸ float32 numbers: 1 GiB)
FALLBACK_ROW_ELEMENTS = 2**28


def free_bytes(device: torch.device | str | None = None) -> int | None:
    """The free memory of ``device`` in bytes (CUDA: the driver's count; CPU: the kernel's
    ``MemAvailable``, else the free physical pages), or None where it cannot be read."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def row_element_limit(
    device: torch.device | str | None = None,
    bytes_per_element: int = 4,
    share: float = ROW_MEMORY_SHARE,
) -> int:
    """The numbers of kept rows that take at most ``share`` of the free memory of ``device``
    (:data:`FALLBACK_ROW_ELEMENTS` where it cannot be read)."""
    free = free_bytes(device)
    if free is None:
        return FALLBACK_ROW_ELEMENTS
    return max(int(share * free) // bytes_per_element, 1)


def row_elements(options: object, device: torch.device | str | None = None) -> int:
    """``options.max_row_elements`` (a structure's options), or when it is None the limit of
    the free memory of ``device`` (:func:`row_element_limit`)."""
    given = getattr(options, "max_row_elements", None)
    return int(given) if given is not None else row_element_limit(device)


def rows_refusal(
    kept_rows: int, width: int, max_row_elements: int, sketch: RowSketch | None
) -> StructureTooLargeError:
    """The error for ``kept_rows`` probe rows of ``width`` numbers over ``max_row_elements``
    where the probe kernel cannot move to its P × P side: the sample side asked for, or rows
    already sketched (named by their ``sketch``), with the fixes."""
    if sketch is not None:
        return StructureTooLargeError(
            f"structure='probe_kernel' keeps {kept_rows:,} probe rows sketched to {width:,} "
            f"numbers (KernelOptions.sketch_factor={sketch.factor}), above KernelOptions."
            f"max_row_elements={max_row_elements:,} (the rows' memory); pass a larger "
            "sketch_factor, leave it to structure='auto' (which sketches until the rows fit), "
            "or max_samples=."
        )
    return StructureTooLargeError(
        f"structure='probe_kernel' on the sample side keeps {kept_rows:,} probe rows of "
        f"{width:,} parameters, above KernelOptions.max_row_elements={max_row_elements:,} "
        "(the rows' memory); pass max_samples=, side='parameters' (P ≤ max_parameters) or "
        "structure='cg'."
    )
