"""The options of each structure, one frozen dataclass per structure, validated once.

An options object names its structure (``options.structure``) and holds every option of it; it
is the one way to set a structure's options, and what ``measure()``, the monitor, the sweep and
the configs pass around: ``measure(model, batches, ..., structure=KFACOptions(kfac_mode=
"probe"))`` and ``FlatnessMonitor(structure=KernelOptions(probes=8))`` measure with it. A plain
name (``"kfac"``) measures with that structure's defaults, the object
:func:`structure_options` returns for it; the same function builds an object from a mapping of
its fields (a YAML file's), naming any unknown one. The pipeline and the backends receive the
object unchanged and read only it, so a bad option fails when the object is built, with the
same message.

==============================  ==========================  =====================================
structure                       dataclass                   options
==============================  ==========================  =====================================
``probe_kernel``                :class:`KernelOptions`      ``probes``, ``groups``, ``side``,
                                                            size guards, quadrature, sketch,
                                                            ``summary_only``, ``trace_estimator``
``kfac``                        :class:`KFACOptions`        ``kfac_mode``, ``mc_samples``,
                                                            ``trace_estimator``
``diag``, ``diag_mc``           :class:`DiagOptions`        ``sampled`` (``diag_mc``),
                                                            ``mc_samples``, ``trace_estimator``
``dense``                       :class:`DenseOptions`       ``trace_estimator``,
                                                            ``max_parameters``
``gram``                        :class:`GramOptions`        ``trace_estimator``,
                                                            ``max_kernel_size``
``cg``, ``lanczos``,            :class:`MatrixFreeOptions`  ``structure``, ``probes``, steps,
``hutchinson``                                              tolerances, ``trace_estimator``, ...
==============================  ==========================  =====================================

The matrix-free options are tabled in :mod:`lightning_flatness.core.backends.matrix_free`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from lightning_flatness.core.checks import check_choice, check_count
from lightning_flatness.core.curvature.row_sketch import SketchPlan

__all__ = [
    "ALL_STRUCTURES",
    "HOOK_STRUCTURES",
    "MATRIX_FREE_STRUCTURES",
    "STRUCTURES",
    "DenseOptions",
    "DiagOptions",
    "GramOptions",
    "KFACOptions",
    "KernelOptions",
    "MatrixFreeOptions",
    "OPTION_CLASSES",
    "DEFAULT_GROUPS",
    "DEFAULT_PROBES",
    "StructureOptions",
    "structure_options",
]

#: every structure that is not matrix-free; ``kfac``, ``diag``, ``diag_mc`` from layer hooks,
#: ``dense`` and ``gram`` from BackPACK
STRUCTURES = ("dense", "gram", "kfac", "diag", "diag_mc", "probe_kernel")
#: the structures measured from layer hooks
HOOK_STRUCTURES = ("kfac", "diag", "diag_mc", "probe_kernel")
#: structures computed from Fisher-vector products with torch.func (any differentiable model)
MATRIX_FREE_STRUCTURES = ("lanczos", "hutchinson", "cg")
ALL_STRUCTURES = STRUCTURES + MATRIX_FREE_STRUCTURES

#: the two ways of getting Tr(F) for BackPACK's structures
EXACT_OR_SAMPLED = ("exact", "sampled")
#: the Fisher rows of the layer-hook structures (kfac_mode, and their trace_estimator):
#: exact, drawn labels, or Rademacher probes through the output Fisher's square root
HOOK_ROWS = ("exact", "sampled", "probe")


@dataclass(frozen=True)
class KFACOptions:
    """``kfac``: Kronecker factors from ``kfac_mode`` rows (``"exact"``: the C rows of the
    output Fisher's square root; ``"sampled"``: ``mc_samples`` labels drawn per input;
    ``"probe"``: ``mc_samples`` Rademacher probes through that square root)."""

    kfac_mode: str = "exact"
    mc_samples: int = 1
    trace_estimator: str = "exact"

    @property
    def structure(self) -> str:
        return "kfac"

    def __post_init__(self) -> None:
        check_choice("kfac_mode", self.kfac_mode, HOOK_ROWS)
        check_count("mc_samples", self.mc_samples)
        check_choice("trace_estimator", self.trace_estimator, HOOK_ROWS)


@dataclass(frozen=True)
class DiagOptions:
    """``diag`` (the exact diagonal) and ``diag_mc`` (``mc_samples`` sampled labels per input)."""

    sampled: bool = False
    mc_samples: int = 1
    trace_estimator: str = "exact"

    @property
    def structure(self) -> str:
        return "diag_mc" if self.sampled else "diag"

    def __post_init__(self) -> None:
        check_count("mc_samples", self.mc_samples)
        check_choice("trace_estimator", self.trace_estimator, HOOK_ROWS)


@dataclass(frozen=True)
class DenseOptions:
    """``dense``: the P × P Fisher, refused above ``max_parameters`` (None: the default guard)."""

    trace_estimator: str = "exact"
    max_parameters: int | None = None

    @property
    def structure(self) -> str:
        return "dense"

    def __post_init__(self) -> None:
        check_choice("trace_estimator", self.trace_estimator, EXACT_OR_SAMPLED)
        check_count("DenseOptions.max_parameters", self.max_parameters, allow_none=True)


@dataclass(frozen=True)
class GramOptions:
    """``gram``: the mC × mC kernel, refused above ``max_kernel_size`` (None: the default)."""

    trace_estimator: str = "exact"
    max_kernel_size: int | None = None

    @property
    def structure(self) -> str:
        return "gram"

    def __post_init__(self) -> None:
        check_choice("trace_estimator", self.trace_estimator, EXACT_OR_SAMPLED)
        check_count("GramOptions.max_kernel_size", self.max_kernel_size, allow_none=True)


#: the probe kernel's probe rows per sample when neither ``probes`` nor ``groups`` is given and
#: fewer than :data:`~lightning_flatness.core.defaults.SAMPLES_FOR_TWO_PROBES` samples are
#: measured, or when only ``groups`` is given (:func:`~lightning_flatness.core.defaults.
#: default_probes`)
DEFAULT_PROBES = 4
#: the probe kernel's jackknife groups when ``groups`` is not given
DEFAULT_GROUPS = 2
#: Hutchinson probes of the probe kernel's stored-row estimate (each also runs once per left-out
#: group; :mod:`lightning_flatness.core.curvature.stored_rows`) and its Lanczos steps: on a
#: trained BatchNorm ResNet (11,230 parameters, 2,000 samples of 4 probes) 8 probes of 60 steps
#: were within 0.6–1.2% of the formed kernel of the same rows at c = λn = 25 and 2.5, at 3/8 of
#: the products of 16 of 80; 40 steps were up to 4% high at c = 2.5 (docs/RESULTS.md, "The probe
#: kernel past its guards")
SLQ_PROBES = 8
SLQ_STEPS = 60
#: the relative half-width of the stored-row soft rank's quadrature bracket (its Gauss and
#: Gauss–Radau rules) at which the Lanczos runs stop before ``slq_steps``
SLQ_TOLERANCE = 0.02
#: past ``slq_steps`` the runs go on while the bracket is wider than this (the accuracy the
#: default is held to), up to ``slq_extension`` (:data:`SLQ_EXTENSION`) times ``slq_steps`` (1:
#: never past them): at a small λ early in a
#: fit (the 14,514-parameter ladder ResNet, n = 5,000, c = 1, three epochs) 60 steps left
#: ± 33% and 150 steps ± 1.7% (docs/RESULTS.md, "The quadrature's cap at a small λ")
SLQ_LOOSE_TOLERANCE = 0.10
SLQ_EXTENSION = 4
#: how many times shorter the stored rows of a large model are kept (docs/RESULTS.md, "Sketched
#: rows": on the 78,042-parameter ladder ResNet 0.98 of the whole rows' soft rank at half their
#: cost; 8 times shorter, 0.95 at a third)
SKETCH_FACTOR = 4
#: the fewest parameters whose stored rows are sketched (below, the stored-row estimate of the
#: whole rows costs under 30 training epochs on the ladder's first rung)
SKETCH_FROM_PARAMETERS = 32_768
#: the sketch's jackknife groups (each left out once, beside the probe groups; 2, 4 and 8 gave
#: the same value, 2 the smallest error bar and the fewest products)
SKETCH_GROUPS = 2


@dataclass(frozen=True)
class KernelOptions:
    """``probe_kernel``: ``probes`` Rademacher probe rows per sample in ``groups`` jackknife
    groups (both None, the default, as for the name ``"probe_kernel"``: chosen from the number
    of samples measured, :func:`~lightning_flatness.core.defaults.kernel_rows`, and measured
    again with the exact output rows where the soft rank nears the probe rows,
    :mod:`~lightning_flatness.core.probe_bias`; one of them None: :data:`DEFAULT_PROBES` or
    :data:`DEFAULT_GROUPS`); the spectrum on the ``side`` of the parameters (P × P,
    P ≤ ``max_parameters``) or of the samples (ms × ms, ms ≤ ``max_kernel_size`` for a formed
    kernel; more rows, where P × P does not fit, by stochastic Lanczos quadrature on them with
    ``slq_probes`` probes of at most ``slq_steps`` steps, ending once the soft rank is
    bracketed to ``slq_tolerance``, and going on to ``slq_extension`` times those steps while
    the bracket is wider than :data:`SLQ_LOOSE_TOLERANCE`), at most ``max_row_elements``
    numbers of kept rows (None: the rows may take
    :data:`~lightning_flatness.core.memory.ROW_MEMORY_SHARE` of the free memory of the model's
    device); from ``sketch_from_parameters`` parameters on, those rows are kept
    ``sketch_factor`` times shorter by a random projection in ``sketch_groups`` groups whose
    jackknife removes its bias (1: never; :mod:`lightning_flatness.core.curvature.row_sketch`);
    ``"auto"`` takes the smaller (:mod:`lightning_flatness.core.curvature.probe_kernel`).
    ``summary_only``: the trace functions alone (the soft rank and its kin), for a caller that
    needs no more — a formed kernel's by one Cholesky factorisation instead of its
    eigendecomposition (no eigenvalue spectrum beyond the largest), and no Newton decrement
    (its solves and the gradient's projection on the rows are skipped; the report's decrement
    is NaN, so its ``trusted`` lacks that check: keep it False for a number to be read as it
    stands).
    """

    probes: int | None = None
    groups: int | None = None
    side: str = "auto"
    max_parameters: int = 8192
    max_kernel_size: int = 8192
    max_row_elements: int | None = None
    trace_estimator: str = "exact"
    slq_probes: int = SLQ_PROBES
    slq_steps: int = SLQ_STEPS
    slq_tolerance: float = SLQ_TOLERANCE
    slq_extension: int = SLQ_EXTENSION
    sketch_factor: int = SKETCH_FACTOR
    sketch_from_parameters: int = SKETCH_FROM_PARAMETERS
    sketch_groups: int = SKETCH_GROUPS
    summary_only: bool = False

    @property
    def structure(self) -> str:
        return "probe_kernel"

    @property
    def default_rows(self) -> bool:
        """Neither ``probes`` nor ``groups`` given: the rows are chosen from the samples
        measured (:func:`~lightning_flatness.core.defaults.kernel_rows`)."""
        return self.probes is None and self.groups is None

    @property
    def sketching(self) -> SketchPlan:
        """When and how the rows kept for the stored-row estimate are sketched."""
        return SketchPlan(self.sketch_factor, self.sketch_groups, self.sketch_from_parameters)

    def __post_init__(self) -> None:
        for name in ("probes", "groups"):
            check_count(f"KernelOptions.{name}", getattr(self, name), allow_none=True)
        names = ("max_parameters", "max_kernel_size", "slq_probes", "slq_extension")
        for name in (*names, "sketch_factor", "sketch_from_parameters", "sketch_groups"):
            check_count(f"KernelOptions.{name}", getattr(self, name))
        check_count("KernelOptions.slq_steps", self.slq_steps)
        if not 0 < self.slq_tolerance < 1:
            raise ValueError(
                f"KernelOptions.slq_tolerance={self.slq_tolerance!r} must be in (0, 1): the "
                "relative half-width of the soft rank's quadrature bracket, e.g. 0.02."
            )
        check_count("KernelOptions.max_row_elements", self.max_row_elements, allow_none=True)
        check_choice("KernelOptions.side", self.side, ("auto", "parameters", "samples"))
        check_choice("trace_estimator", self.trace_estimator, HOOK_ROWS)
        if not isinstance(self.summary_only, bool):
            raise ValueError(
                f"KernelOptions.summary_only must be True or False, got {self.summary_only!r}."
            )
        probes = DEFAULT_PROBES if self.probes is None else self.probes
        groups = DEFAULT_GROUPS if self.groups is None else self.groups
        if probes % groups:
            raise ValueError(
                f"KernelOptions.groups={groups} must divide KernelOptions.probes={probes} (each "
                "jackknife group holds the same number of probes)."
            )


_CHOICES = {
    "space": ("auto", "parameters", "samples"),
    "start": ("range", "random"),
    "distribution": ("rademacher", "gaussian"),
    "trace_estimator": ("auto", "exact", "sampled"),
    "preconditioner": ("kfac", "none"),
}


@dataclass(frozen=True)
class MatrixFreeOptions:
    """``structure`` ∈ ``cg``, ``lanczos``, ``hutchinson``: the soft rank from Fisher-vector
    products (fields: the table in :mod:`lightning_flatness.core.backends.matrix_free`)."""

    structure: str = "cg"
    probes: int = 10
    lanczos_steps: int = 40
    space: str = "auto"
    start: str = "range"
    distribution: str = "rademacher"
    trace_estimator: str = "auto"
    chunk_elements: int = 2**25
    chunk_size: int | None = None
    power_iterations: int = 50
    bounds: bool = True
    cache: bool = True
    rank: int | None = None
    max_basis_elements: int = 2**28
    max_histogram: int = 100_000
    breakdown_tol: float | None = None
    cg_steps: int = 60
    cg_tol: float = 0.02
    preconditioner: str = "kfac"

    def __post_init__(self) -> None:
        check_choice("structure", self.structure, MATRIX_FREE_STRUCTURES)
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"MatrixFreeOptions.{name} must be one of {choices}, "
                    f"got {getattr(self, name)!r}."
                )
        if not 0 < float(self.cg_tol) < 1:
            raise ValueError(f"MatrixFreeOptions.cg_tol must be in (0, 1), got {self.cg_tol!r}.")
        for name in ("probes", "lanczos_steps", "chunk_elements", "max_histogram", "cg_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(
                    f"MatrixFreeOptions.{name} must be ≥ 1, got {getattr(self, name)!r}."
                )
        if self.chunk_size is not None and int(self.chunk_size) < 1:
            raise ValueError(f"chunk_size must be ≥ 1 or None, got {self.chunk_size!r}.")
        if self.start == "random" and self.space == "samples":
            raise ValueError(
                "start='random' draws probes in parameter space; use space='parameters' or "
                "'auto' with it, or start='range'."
            )


StructureOptions = (
    KFACOptions | DiagOptions | DenseOptions | GramOptions | MatrixFreeOptions | KernelOptions
)
#: the option dataclasses, one per structure (``options.structure`` names it)
OPTION_CLASSES = (
    KFACOptions,
    DiagOptions,
    DenseOptions,
    GramOptions,
    MatrixFreeOptions,
    KernelOptions,
)


def structure_options(
    structure: str, values: Mapping[str, object] | None = None
) -> StructureOptions:
    """The options object of the structure named ``structure``: its defaults (what
    ``measure()`` measures the name with), with ``values`` (a mapping of the object's fields,
    e.g. read from a YAML file) in their place.

    Raises:
        ValueError: an unknown structure, a field the structure's options do not have (naming
            the fields they do), or a bad value (naming it).
    """
    check_choice("structure", structure, ALL_STRUCTURES)
    kind = _OPTION_CLASS_OF[structure]
    named: dict[str, object] = {"structure": structure} if kind is MatrixFreeOptions else {}
    if kind is DiagOptions:
        named = {"sampled": structure == "diag_mc"}
    values = dict(values or {})
    known = sorted({field.name for field in fields(kind)} - set(named))
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"{kind.__name__} (structure={structure!r}) has no option {unknown}; its options "
            f"are {known}."
        )
    return kind(**named, **values)


#: the options class of each structure name
_OPTION_CLASS_OF = {
    "probe_kernel": KernelOptions,
    "kfac": KFACOptions,
    "diag": DiagOptions,
    "diag_mc": DiagOptions,
    "dense": DenseOptions,
    "gram": GramOptions,
    **dict.fromkeys(MATRIX_FREE_STRUCTURES, MatrixFreeOptions),
}
