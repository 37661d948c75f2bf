"""``structure="auto"``: the default structure, the one whose soft rank is of exact quality at
the lowest cost where it fits (docs/RESULTS.md, "Error against cost").

That is ``probe_kernel``: the whole Fisher's spectrum from a few probe rows per sample, within a
few percent of the exact soft rank on every model measured. It fits when its P × P state does
(P ≤ ``max_parameters``: any number of samples, and sums across processes) or when the kept
probe rows of the measured samples fit in memory (m·s·P ≤ ``max_row_elements``, by default a
share of the free memory, shared by the processes of one machine): on one process a formed
kernel for m·s ≤ ``max_kernel_size``, beyond it stochastic Lanczos quadrature on the stored
rows; across processes each keeps its own rows and the quadrature runs in the parameters' space
(:mod:`~lightning_flatness.core.curvature.spread_rows`). Otherwise the default is ``cg``:
Hutchinson with preconditioned conjugate gradients on exact Fisher-vector products, matrix-free
for any size (0.93–0.97 of the exact soft rank on the same models; only the soft rank, no
log-det or spectrum).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from lightning_flatness.core.curvature.stored_rows import keeps_rows
from lightning_flatness.core.failures import AllReduce
from lightning_flatness.core.memory import row_elements
from lightning_flatness.core.options import DEFAULT_GROUPS, DEFAULT_PROBES, KernelOptions

__all__ = [
    "AUTO",
    "StructureChoice",
    "agreed_sketch_factor",
    "auto_choice",
    "choose_across_processes",
    "choose_structure",
    "default_probes",
    "kernel_rows",
    "row_width",
]

#: the structure argument that asks for this choice
AUTO = "auto"
#: ``probe_kernel`` takes 2 probes per sample (not 4) from this many measured samples on
SAMPLES_FOR_TWO_PROBES = 8192


def default_probes(num_samples: int | None) -> int:
    """The probe kernel's probes per sample when the user names none: 4, and 2 from
    :data:`SAMPLES_FOR_TWO_PROBES` measured samples on.

    The probes' bias left after the jackknife falls with the number of probe rows m·s, not with
    s alone (measured on the paper's trained models, 2 probes: 0.963 and 0.980 of exact on the
    CNN at m = 2,048 and 4,000, 0.981 and 0.994 on the MLP; 4 probes: 1.006–1.009), while the
    P × P sums cost m·s·P². From 8,192 samples 2 probes give at least the 16,384 rows that 4 give
    at 4,096, at half the sums' cost (docs/RESULTS.md, "The default at the main job's size").
    """
    if num_samples is not None and num_samples >= SAMPLES_FOR_TWO_PROBES:
        return 2
    return DEFAULT_PROBES


def kernel_rows(options: KernelOptions, num_samples: int | None) -> KernelOptions:
    """``options`` with its probe rows settled for ``num_samples`` measured samples (None:
    unknown, many): ``probes`` and ``groups`` both None take :func:`default_probes` in
    :data:`~lightning_flatness.core.options.DEFAULT_GROUPS` groups; one of them None, its
    default (:data:`~lightning_flatness.core.options.DEFAULT_PROBES` probes, or
    ``DEFAULT_GROUPS`` groups)."""
    if options.probes is not None and options.groups is not None:
        return options
    probes = options.probes
    if probes is None:
        probes = default_probes(num_samples) if options.groups is None else DEFAULT_PROBES
    groups = DEFAULT_GROUPS if options.groups is None else options.groups
    return replace(options, probes=probes, groups=groups)


#: the largest sketch factor the automatic choice raises ``sketch_factor`` to where the rows of
#: the measured samples do not fit their memory otherwise
MAX_SKETCH_FACTOR = 64


def row_width(num_parameters: int, options: KernelOptions, factor: int | None = None) -> int:
    """The numbers the probe kernel keeps per probe row of ``num_parameters`` past its formed
    kernel: P, or the sketched width where its options sketch such rows
    (:mod:`~lightning_flatness.core.curvature.row_sketch`), at ``factor`` if given."""
    plan = options.sketching if factor is None else replace(options.sketching, factor=factor)
    if not plan.applies(num_parameters, options.max_parameters, options.side):
        return num_parameters
    return plan.width(num_parameters)


def fitting_sketch_factor(
    num_parameters: int,
    rows: int,
    options: KernelOptions,
    device: torch.device | str | None,
    sharing: int = 1,
) -> int | None:
    """The smallest of ``sketch_factor``, twice it, … up to :data:`MAX_SKETCH_FACTOR` at which
    ``rows`` probe rows fit their memory (:func:`row_width`), of which ``sharing`` processes
    each take an equal part; None where none does."""
    limit = row_elements(options, device) // max(int(sharing), 1)
    factor = options.sketch_factor
    while True:
        width = row_width(num_parameters, options, factor)
        if rows * width <= limit:
            return factor
        if width == num_parameters or factor * 2 > MAX_SKETCH_FACTOR:
            return None
        factor *= 2


@dataclass(frozen=True)
class StructureChoice:
    """The structure ``"auto"`` resolves to, and why (one sentence for a log message)."""

    structure: str
    reason: str
    #: the probe kernel's sketch factor that fits the rows in memory (None: its option's)
    sketch_factor: int | None = None


def choose_structure(
    num_parameters: int,
    num_samples: int | None,
    options: KernelOptions,
    *,
    summable: bool = False,
    device: torch.device | str | None = None,
    sharing: int = 1,
) -> StructureChoice:
    """``probe_kernel`` where it fits, else ``cg`` (module docstring).

    Args:
        num_parameters: P, the trainable parameters.
        num_samples: m, the samples a measurement will see on this process (None: unknown,
            many).
        options: the probe kernel's options (sizes and probes; probes left None are those
            :func:`kernel_rows` settles for ``num_samples``).
        summable: the state must add up across processes (data parallelism).
        device: where the rows would be kept (their memory guard).
        sharing: the processes whose rows share that memory (those of one machine on the CPU).
    """
    options = kernel_rows(options, num_samples)
    if num_parameters <= options.max_parameters:
        return StructureChoice(
            "probe_kernel",
            f"probe_kernel: {num_parameters:,} parameters ≤ max_parameters "
            f"{options.max_parameters:,}, so the P × P state fits for any number of samples",
        )
    if num_samples is not None:
        rows = num_samples * options.probes
        factor = fitting_sketch_factor(num_parameters, rows, options, device, sharing)
        if factor is not None and summable:
            return _spread_choice(num_parameters, rows, options, factor)
        if factor is not None:
            width = row_width(num_parameters, options, factor)
            stored = keeps_rows(
                num_parameters,
                rows,
                side=options.side,
                max_parameters=options.max_parameters,
                max_kernel_size=options.max_kernel_size,
            )
            how = (
                "memory; the kernel's trace functions come from Lanczos quadrature on them"
                if stored
                else "the sample-side kernel"
            )
            if width < num_parameters:
                how += f", each sketched to {width:,} numbers (docs/math.md, sketched rows)"
            return StructureChoice(
                "probe_kernel",
                f"probe_kernel: {rows:,} probe rows of {num_parameters:,} parameters fit {how}",
                factor if factor != options.sketch_factor else None,
            )
    across = " across processes" if summable else ""
    samples = "an unknown number of" if num_samples is None else f"{num_samples:,}"
    if summable and num_samples is not None:
        samples += " (per process)"
    return StructureChoice(
        "cg",
        f"cg: the probe kernel does not fit{across} ({num_parameters:,} parameters > "
        f"max_parameters {options.max_parameters:,}, and the probe rows of {samples} samples × "
        f"{options.probes} probes exceed the memory they may take), so the "
        "soft rank comes from preconditioned conjugate gradients on Fisher-vector products "
        "(matrix-free; no log-det or spectrum). Measure fewer samples (max_samples=) for the "
        "probe kernel",
    )


def _spread_choice(
    num_parameters: int, rows: int, options: KernelOptions, factor: int
) -> StructureChoice:
    """The probe kernel across processes above ``max_parameters``: each process keeps its rows
    (sketched where the sketch applies: every process alike, from its first rows)."""
    width = row_width(num_parameters, options, factor)
    how = f", each sketched to {width:,} numbers" if width < num_parameters else ""
    return StructureChoice(
        "probe_kernel",
        f"probe_kernel: each process keeps its {rows:,} probe rows of {num_parameters:,} "
        f"parameters{how}; the trace functions come from Lanczos quadrature in the parameters' "
        "space, its products summed across processes",
        factor if factor != options.sketch_factor else None,
    )


def agreed_sketch_factor(
    choice: StructureChoice, options: KernelOptions, all_reduce: AllReduce
) -> StructureChoice:
    """One choice for every process: each read its own free memory, so their sketch factors
    may differ; all take the largest, and ``cg`` if any process chose it. Every process calls
    this together (``all_reduce`` sums a tensor across them in place)."""
    factor = choice.sketch_factor or options.sketch_factor
    doublings = (factor // options.sketch_factor).bit_length()  # factor = sketch_factor · 2^(d−1)
    votes = torch.zeros(1 + MAX_SKETCH_FACTOR.bit_length(), dtype=torch.float64)
    votes[0] = float(choice.structure == "cg")  # the processes that chose cg
    votes[1 : 1 + doublings] = 1.0  # the most doublings through a sum: one count per level
    reduced = all_reduce(votes)
    if float(reduced[0]) > 0:
        return (
            choice
            if choice.structure == "cg"
            else StructureChoice("cg", "cg: the probe rows do not fit on every process")
        )
    largest = options.sketch_factor << (int((reduced[1:] > 0).sum()) - 1)
    return replace(choice, sketch_factor=largest if largest != options.sketch_factor else None)


def choose_across_processes(
    num_parameters: int,
    num_samples: int | None,
    options: KernelOptions,
    *,
    device: torch.device | str | None,
    all_reduce: AllReduce | None,
    world: int = 1,
    sharing: int = 1,
) -> StructureChoice:
    """:func:`choose_structure` for ``num_samples`` over ``world`` processes (each measures its
    share; with ``all_reduce`` every process calls this together and all take one choice,
    :func:`agreed_sketch_factor`); ``sharing``: the processes whose rows share one memory."""
    per_process = None if num_samples is None else -(-num_samples // max(world, 1))
    summable = all_reduce is not None
    choice = choose_structure(
        num_parameters, per_process, options, summable=summable, device=device, sharing=sharing
    )
    return agreed_sketch_factor(choice, options, all_reduce) if summable else choice


def auto_choice(
    model: nn.Module,
    num_samples: int,
    *,
    all_reduce: AllReduce | None = None,
    shard: tuple[int, int] | None = None,
) -> StructureChoice:
    """What ``structure="auto"`` measures ``model`` with on ``num_samples`` samples (all
    processes' together, ``shard=(rank, world_size)`` under data parallelism): the probe
    kernel at its default rows where it fits, else ``cg`` (:func:`choose_across_processes`;
    on the CPU the processes share one machine's memory, as far as can be told)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    world = shard[1] if shard is not None else 1
    return choose_across_processes(
        trainable,
        num_samples,
        kernel_rows(KernelOptions(), num_samples),
        device=device,
        all_reduce=all_reduce,
        world=world,
        sharing=world if device.type == "cpu" else 1,
    )
