"""A convolution's terms of the hooked pass without unfolding its input (docs/math.md,
"Kronecker factors from layer hooks"): KFC's input factor ``A = Σ_i Σ_t a_it a_itᵀ`` of a
stride-1 convolution from its input's shifted overlaps (:func:`overlap_input_factor`, where
:func:`overlap_pays`), and every sample's weight gradient from the layer's own weight-gradient
convolution with the samples as groups (:func:`grouped_weight_gradients`, for the per-sample
norms).

The patch ``a_t`` of output position ``t`` holds the input at ``t + p`` for the kernel offsets
``p``. The block of ``A`` at offsets ``(p, p')`` is therefore a sum of products of the input with
itself shifted by ``δ = p' − p``,

    A_{p,p'} = Σ_i Σ_{u ∈ R_{p,δ}} x_i[u] x_i[u + δ]ᵀ        (C × C),

over the positions ``u`` of the image that output positions read at offset ``p`` while
``u + δ`` is in the image too (the zero padding adds nothing). For one shift δ the regions of
the offsets differ from the whole overlap ``O_δ`` of the image with its shifted copy only by a
few rows and columns at its edges, so each block is the overlap's sum minus the sums over its
excluded rows and columns plus those over the excluded corners (inclusion–exclusion). One
matrix product of the C-channel input per shift, ``(2k−1)²/2`` of them counting ``A_{p',p} =
A_{p,p'}ᵀ``, replaces the ``(C·k²)²`` products per output position (``k⁴`` blocks of C × C)
that the unfolded patches cost: a 3×3 convolution's factor takes about a sixth of the
multiply-adds, and the unfolded copy of the input is not needed for it. The overlap's sum is
one matrix product of two views of the input laid out as a zero-separated line
(:func:`_padded_line`), with no copy per shift.

Pure torch; no Lightning import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

import torch
from torch import Tensor

__all__ = [
    "OVERLAP_SHIFT_OVERHEAD",
    "grouped_weight_gradients",
    "overlap_input_factor",
    "overlap_pays",
    "EDGE_COPY_COST",
    "EDGE_LINE_OVERHEAD",
    "UNFOLD_COPY_COST",
]

#: multiply-adds that the per-shift operations of the overlap factor cost in fixed overhead
#: (their Python and small tensors, measured against the unfolded product on one CPU thread)
OVERLAP_SHIFT_OVERHEAD = 4_000_000
#: the same for one edge row or column of a shift's correction, and per number of it (its
#: copy into a line of its own, :class:`_EdgeLines`, and the product's reads): an unpadded
#: convolution has four times as many edge lines as a padded one, and on small images they
#: cost more than the unfolded patches
EDGE_LINE_OVERHEAD = 1_500_000
EDGE_COPY_COST = 100
#: multiply-adds that writing and reading one number of the unfolded patches costs (the copy
#: dominates the unfolded product of a convolution with few input channels)
UNFOLD_COPY_COST = 200


def overlap_pays(
    x: Tensor,
    kernel_size: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    unfolded_anyway: bool = False,
) -> bool:
    """Whether a stride-1 convolution's input factor for the batch ``x`` (N, C, *spatial)
    costs less from its shifted overlaps (about ``(2k−1)²/2`` products of the C-channel input
    laid out with ``(k−1)·dilation`` zeros after each row and sample, plus
    :data:`OVERLAP_SHIFT_OVERHEAD` per shift, and the edge corrections' rows and columns,
    :data:`EDGE_LINE_OVERHEAD` each plus :data:`EDGE_COPY_COST` per number and their products)
    than from its unfolded patches (``N·T·(C·k²)²`` multiply-adds plus
    :data:`UNFOLD_COPY_COST` per unfolded number, unless the patches are ``unfolded_anyway``
    for something else). A one-dimensional convolution counts as one row."""
    samples, channels = x.shape[0], x.shape[1]
    geometry = [tuple(value) for value in (x.shape[2:], kernel_size, dilation, padding)]
    if len(geometry[0]) == 1:
        geometry = [(fill, *value) for fill, value in zip((1, 1, 1, 0), geometry, strict=True)]
    sizes, kernel_size, dilation, padding = geometry
    kernel = math.prod(kernel_size)
    outputs = math.prod(
        size + 2 * pad - dil * (k - 1)
        for size, pad, dil, k in zip(sizes, padding, dilation, kernel_size, strict=True)
    )
    padded = math.prod(
        size + dil * (k - 1) for size, dil, k in zip(sizes, dilation, kernel_size, strict=True)
    )
    copy = 0 if unfolded_anyway else UNFOLD_COPY_COST
    unfolded = samples * outputs * channels * kernel * (channels * kernel + copy)
    plan = _plan(*geometry)
    overlaps = len(plan) * (samples * padded * channels**2 + OVERLAP_SHIFT_OVERHEAD)
    line = samples * channels * (EDGE_COPY_COST + channels)  # per position of an edge line
    for step in plan:
        positions = len(step.edge_rows) * len(step.cols) + len(step.edge_cols) * len(step.rows)
        edges = len(step.edge_rows) + len(step.edge_cols)
        overlaps += edges * EDGE_LINE_OVERHEAD + positions * line
    return overlaps < unfolded


def _window(offset: int, shift: int, size: int, padding: int, out_size: int) -> range:
    """The image positions ``u`` (one dimension) that output positions read at kernel offset
    ``offset`` (already times the dilation) and whose shifted partner ``u + shift`` is in the
    image: ``[offset − padding, offset − padding + out_size) ∩ [0, size) ∩ [−shift, size −
    shift)``."""
    start = max(offset - padding, 0, -shift)
    stop = min(offset - padding + out_size, size, size - shift)
    return range(start, max(start, stop))


def _overlap(shift: int, size: int) -> range:
    """All image positions ``u`` with ``u + shift`` in the image (one dimension)."""
    return range(max(0, -shift), min(size, size - shift))


@dataclass(frozen=True)
class _Shift:
    """One shift δ: the overlap's rows and columns, its edge rows and columns (relative to the
    overlap), and for each pair of kernel offsets ``(p, p + δ)`` with a non-empty region its
    flat offsets and which edges its region leaves out (0/1 rows of ``excluded_rows`` (P, E_r)
    and ``excluded_cols`` (P, E_c))."""

    shift: tuple[int, int]
    rows: range
    cols: range
    edge_rows: tuple[int, ...]
    edge_cols: tuple[int, ...]
    first: tuple[int, ...]  # flat kernel offset p = i·kw + j of each pair
    second: tuple[int, ...]  # flat kernel offset of p + δ
    excluded_rows: tuple[tuple[int, ...], ...]
    excluded_cols: tuple[tuple[int, ...], ...]


@lru_cache(maxsize=256)
def _plan(
    sizes: tuple[int, int],
    kernel_size: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
) -> tuple[_Shift, ...]:
    """The shifts δ ≥ 0 (lexicographically; ``A_{p',p} = A_{p,p'}ᵀ`` gives the others) that
    have a pair of offsets with a non-empty region, for one input size and convolution."""
    out = tuple(
        size + 2 * pad - dil * (k - 1)
        for size, pad, dil, k in zip(sizes, padding, dilation, kernel_size, strict=True)
    )
    kh, kw = kernel_size
    shifts = []
    for dh, dw in product(range(-(kh - 1), kh), range(-(kw - 1), kw)):
        if (dh, dw) < (0, 0):
            continue
        shift = (dh * dilation[0], dw * dilation[1])
        rows, cols = _overlap(shift[0], sizes[0]), _overlap(shift[1], sizes[1])
        windows = {}
        for i, j in product(range(kh), range(kw)):
            if not (0 <= i + dh < kh and 0 <= j + dw < kw):
                continue
            window = tuple(
                _window(index * dil, s, size, pad, o)
                for index, dil, s, size, pad, o in zip(
                    (i, j), dilation, shift, sizes, padding, out, strict=True
                )
            )
            if window[0] and window[1]:
                windows[(i, j)] = window
        if not rows or not cols or not windows:
            continue
        edge_rows = sorted({r for w in windows.values() for r in rows if r not in w[0]})
        edge_cols = sorted({c for w in windows.values() for c in cols if c not in w[1]})
        shifts.append(
            _Shift(
                shift=shift,
                rows=rows,
                cols=cols,
                edge_rows=tuple(r - rows.start for r in edge_rows),
                edge_cols=tuple(c - cols.start for c in edge_cols),
                first=tuple(i * kw + j for i, j in windows),
                second=tuple((i + dh) * kw + j + dw for i, j in windows),
                excluded_rows=tuple(
                    tuple(int(r not in w[0]) for r in edge_rows) for w in windows.values()
                ),
                excluded_cols=tuple(
                    tuple(int(c not in w[1]) for c in edge_cols) for w in windows.values()
                ),
            )
        )
    return tuple(shifts)


def _products(first: Tensor, second: Tensor) -> Tensor:
    """``Σ first secondᵀ`` over the last dimension: ``(..., C, C)`` from two ``(..., C, M)``."""
    return first @ second.transpose(-1, -2)


def overlap_input_factor(
    x: Tensor,
    kernel_size: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
) -> Tensor:
    """``Σ_i Σ_t a_it a_itᵀ`` of the patches ``F.unfold(x, kernel_size, dilation, padding,
    stride=1)`` of ``x`` (N, C, H, W), without unfolding: (C·kh·kw, C·kh·kw) in ``F.unfold``'s
    order of coordinates (channel, then kernel row, then kernel column). Module docstring for
    the identity; exact up to rounding."""
    channels = x.shape[1]
    kh, kw = kernel_size
    offsets = kh * kw
    plan = _plan(tuple(x.shape[2:]), tuple(kernel_size), tuple(dilation), tuple(padding))
    flat, by_channel, start, row_length = _padded_line(x, kernel_size, dilation)
    length = by_channel.shape[1] * by_channel.stride(1)  # the samples' stretch of the line
    pad_h, pad_w = (kh - 1) * dilation[0], (kw - 1) * dilation[1]
    lines = _EdgeLines(by_channel, pad_w, pad_h)
    blocks = x.new_zeros(offsets, offsets, channels, channels)
    for step in plan:
        sh, sw = step.shift
        # the whole overlap's sum: the line against itself shifted by δ (the zeros between rows
        # and samples make every product that leaves the image vanish); no copy
        partner = start + sh * row_length + sw
        whole = _products(flat[:, start : start + length], flat[:, partner : partner + length])
        found = whole.expand(len(step.first), channels, channels)
        if step.edge_rows or step.edge_cols:
            found = found - _edge_corrections(lines, step)
        p = torch.tensor(step.first, device=x.device)
        q = torch.tensor(step.second, device=x.device)
        blocks[p, q] = found
        blocks[q, p] = found.transpose(-1, -2)
    # (p, q, C, C') → (C, p, C', q): F.unfold's coordinate is channel-major
    blocks = blocks.permute(2, 0, 3, 1).reshape(channels * offsets, channels * offsets)
    return blocks


def _padded_line(
    x: Tensor, kernel_size: tuple[int, int], dilation: tuple[int, int]
) -> tuple[Tensor, Tensor, int, int]:
    """The input (N, C, H, W) laid out as one line per channel, ``flat`` (C, L): every image
    row followed by ``(kw − 1)·dw`` zeros and every sample by ``(kh − 1)·dh`` zero rows, with
    zero margins before and after. A shift δ = (δh, δw) of the image is then the offset
    ``δh·row_length + δw`` along the line, and the products of the image with its shifted
    copy are one matrix product of two views of ``flat``. Also the image inside it as a view
    ``by_channel`` (C, N, H, W), and the line's first image position ``start``."""
    samples, channels, height, width = x.shape
    pad_h, pad_w = (kernel_size[0] - 1) * dilation[0], (kernel_size[1] - 1) * dilation[1]
    row_length, sample_rows = width + pad_w, height + pad_h
    start, end = pad_w, pad_h * row_length + pad_w  # the most a shift reaches either way
    body = samples * sample_rows * row_length
    flat = x.new_zeros(channels, start + body + end)
    padded = flat[:, start : start + body].view(channels, samples, sample_rows, row_length)
    by_channel = padded[:, :, :height, :width]
    by_channel.copy_(x.transpose(0, 1))
    return flat, by_channel, start, row_length


class _EdgeLines:
    """Single rows and columns of the image, each copied once per factor into a line of its
    own with its padding zeros and zero margins (a row followed by the ``(kw − 1)·dw`` zeros
    of the padded layout, a column by the ``(kh − 1)·dh`` zero rows after each sample): the
    sums of one edge row (or column) against its partner shifted by δ are then one matrix
    product of two views, and each row or column is copied once for all shifts.

    Args:
        image: the image inside the padded layout, (C, N, H, W), a view of it.
        pad_w, pad_h: the zeros after each row and the zero rows after each sample.
    """

    def __init__(self, image: Tensor, pad_w: int, pad_h: int) -> None:
        self.image = image
        self.pad_w, self.pad_h = pad_w, pad_h
        self._rows: dict[int, Tensor] = {}
        self._cols: dict[int, Tensor] = {}

    @staticmethod
    def _line(part: Tensor, pad: int) -> Tensor:
        """``part`` (C, N, M) as (C, pad + N·(M + pad) + pad), each sample's M numbers followed
        by ``pad`` zeros."""
        channels, samples, size = part.shape
        line = part.new_zeros(channels, pad + samples * (size + pad) + pad)
        body = line[:, pad : pad + samples * (size + pad)].view(channels, samples, size + pad)
        body[:, :, :size].copy_(part)
        return line

    def row(self, index: int) -> Tensor:
        if index not in self._rows:
            self._rows[index] = self._line(self.image[:, :, index, :], self.pad_w)
        return self._rows[index]

    def column(self, index: int) -> Tensor:
        if index not in self._cols:
            self._cols[index] = self._line(self.image[:, :, :, index], self.pad_h)
        return self._cols[index]

    @staticmethod
    def _shifted_sum(first: Tensor, second: Tensor, pad: int, offset: int) -> Tensor:
        """``first``'s body against ``second``'s moved by ``offset`` along the line (two lines
        of :meth:`_line` with ``pad`` zeros), summed: one product of two views."""
        length = first.shape[1] - 2 * pad
        return _products(
            first[:, pad : pad + length], second[:, pad + offset : pad + offset + length]
        )

    def row_sum(self, row: int, shift: tuple[int, int]) -> Tensor:
        """``Σ_i Σ_u x_i[row, u] x_i[row + δh, u + δw]ᵀ`` (C × C), ``u`` over the columns where
        both are in the image (the zeros take care of the rest)."""
        second = self.row(row + shift[0])
        return self._shifted_sum(self.row(row), second, self.pad_w, shift[1])

    def column_sum(self, column: int, shift: tuple[int, int]) -> Tensor:
        """``Σ_i Σ_u x_i[u, column] x_i[u + δh, column + δw]ᵀ`` (C × C)."""
        second = self.column(column + shift[1])
        return self._shifted_sum(self.column(column), second, self.pad_h, shift[0])

    def corner_sum(self, row: int, column: int, shift: tuple[int, int]) -> Tensor:
        """``Σ_i x_i[row, column] x_i[row + δh, column + δw]ᵀ`` (C × C)."""
        partner = self.image[:, :, row + shift[0], column + shift[1]]
        return _products(self.image[:, :, row, column], partner)


def _edge_corrections(lines: _EdgeLines, step: _Shift) -> Tensor:
    """What each pair's region lacks of the whole overlap's sum (P, C, C): the sums over its
    excluded edge rows and columns, less those over the excluded corners counted twice."""
    dtype, device = lines.image.dtype, lines.image.device
    pairs = len(step.first)
    out_rows = torch.tensor(step.excluded_rows, dtype=dtype, device=device).reshape(pairs, -1)
    out_cols = torch.tensor(step.excluded_cols, dtype=dtype, device=device).reshape(pairs, -1)
    channels = lines.image.shape[0]
    total = lines.image.new_zeros(pairs, channels * channels)
    rows = [step.rows.start + r for r in step.edge_rows]
    cols = [step.cols.start + c for c in step.edge_cols]
    if rows:
        sums = torch.stack([lines.row_sum(r, step.shift) for r in rows])  # (E_r, C, C)
        total += out_rows @ sums.flatten(1)
    if cols:
        sums = torch.stack([lines.column_sum(c, step.shift) for c in cols])  # (E_c, C, C)
        total += out_cols @ sums.flatten(1)
    if rows and cols:
        corners = torch.stack([lines.corner_sum(r, c, step.shift) for r in rows for c in cols])
        both = (out_rows.unsqueeze(2) * out_cols.unsqueeze(1)).reshape(pairs, -1)
        total -= both @ corners.flatten(1)
    return total.reshape(-1, channels, channels)


def grouped_weight_gradients(
    x: Tensor,
    grad: Tensor,
    *,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
) -> Tensor:
    """Each sample's weight gradient of a 2-D convolution, (N, K, o·C·kh·kw), for the inputs
    ``x`` (N, C, H, W) and the output gradients ``grad`` (K, N, o, Ho, Wo) of K cotangents:
    one weight-gradient convolution with the N samples as groups (input (1, N·C, H, W),
    output gradient (1, N·K·o, Ho, Wo)), the layer's own backward kernel."""
    rows, samples, outputs = grad.shape[:3]
    channels = x.shape[1]
    inputs = x.reshape(1, samples * channels, *x.shape[2:])
    by_sample = grad.transpose(0, 1).reshape(1, samples * rows * outputs, *grad.shape[3:])
    found = torch.nn.grad.conv2d_weight(
        inputs,
        (samples * rows * outputs, channels, *kernel),
        by_sample,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=samples,
    )
    return found.reshape(samples, rows, -1)
