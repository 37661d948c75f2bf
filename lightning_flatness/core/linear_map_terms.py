"""The terms of a linear map's weight from its patches and output gradients: per-sample
gradients ``Σ_t s_kit a_itᵀ`` (rows), their squared norms, the batch gradient, entrywise squares
and KFC's Kronecker factors, each for K cotangents at once, over chunks of samples of at most
:data:`CHUNK_ELEMENTS` numbers (docs/math.md, "Kronecker factors from layer hooks").

``a`` is (N, T, d): the patches (rows of the input, unfolded convolution patches, or an
embedding's token indices); ``s`` is (K, N, T, o): the output gradients of K cotangents.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = [
    "CHUNK_ELEMENTS",
    "explicit_gradients_cheaper",
    "kronecker_factors",
    "sample_chunks",
    "weight_batch_gradient",
    "weight_rows",
    "weight_square_sums",
    "weight_squared_norms",
]

#: numbers per vectorized chunk when per-sample gradients are materialised
CHUNK_ELEMENTS = 2**24


def _per_sample_weight_gradients(a: Tensor, s: Tensor) -> Iterator[Tensor]:
    """``Σ_t s_kit a_itᵀ`` for chunks of samples: (chunk, K, o, d) each, one batched matrix
    product per chunk of at most :data:`CHUNK_ELEMENTS` numbers."""
    k, n, t, o = s.shape
    d = a.shape[-1]
    for rows in sample_chunks(n, max(1, CHUNK_ELEMENTS // (k * o * d))):
        s_rows = s[:, rows].permute(1, 0, 3, 2).reshape(-1, k * o, t)
        yield torch.bmm(s_rows, a[rows]).reshape(-1, k, o, d)


def explicit_gradients_cheaper(outputs: int, inputs: int, positions: int) -> bool:
    """Whether a per-sample gradient ``Σ_t s_t a_tᵀ`` (o·d numbers from T·o·d multiply-adds)
    is cheaper to square than the position Gram matrices (T²·(o + d))."""
    return outputs * inputs <= positions * (outputs + inputs)


def weight_squared_norms(a: Tensor, s: Tensor, embedding: bool) -> Tensor:
    """``‖Σ_t s_kit a_itᵀ‖²`` summed over samples, per cotangent: (K,).

    One position: ``‖s‖² ‖a‖²``; else the cheaper of the explicit per-sample gradients and the
    position Gram matrices ``Σ_{t,u} (a_t·a_u)(s_t·s_u)`` (always the latter for embeddings,
    where ``a_t·a_u = [token_t = token_u]``).
    """
    k, n, t, o = s.shape
    if embedding:
        same = (a.unsqueeze(-1) == a.unsqueeze(-2)) & (a >= 0).unsqueeze(-1)
        a_gram = same.to(s.dtype)
        return torch.einsum("ntu,kntu->k", a_gram, torch.einsum("knto,knuo->kntu", s, s))
    if t == 1:
        return torch.einsum("kn,n->k", s.square().sum((-1, -2)), a.square().sum((-1, -2)))
    d = a.shape[-1]
    totals = s.new_zeros(k)
    if explicit_gradients_cheaper(o, d, t):
        for grads in _per_sample_weight_gradients(a, s):
            totals += grads.square().sum((0, 2, 3))
    else:
        per_chunk = max(1, CHUNK_ELEMENTS // (k * t * t))
        for rows in sample_chunks(n, per_chunk):
            a_gram = torch.bmm(a[rows], a[rows].transpose(1, 2))
            s_rows = s[:, rows].reshape(-1, t, o)
            s_gram = torch.bmm(s_rows, s_rows.transpose(1, 2)).reshape(k, -1, t, t)
            totals += (s_gram * a_gram).sum((1, 2, 3))
    return totals


def weight_batch_gradient(a: Tensor, s0: Tensor, embedding: bool, shape: torch.Size) -> Tensor:
    """``Σ_i Σ_t s_it a_itᵀ`` for one cotangent ``s0`` (N, T, o), shaped like the weight."""
    if embedding:
        flat_s = s0.reshape(-1, s0.shape[-1])
        flat_a = a.reshape(-1)
        keep = flat_a >= 0
        grad = s0.new_zeros(shape[0], shape[1])
        grad.index_add_(0, flat_a[keep], flat_s[keep])
        return grad
    return torch.einsum("nto,ntd->od", s0, a).reshape(shape)


def weight_rows(a: Tensor, s: Tensor, embedding: bool, shape: torch.Size) -> Tensor:
    """The per-sample weight gradients ``Σ_t s_kit a_itᵀ`` flattened: (K, N, o·d) (for an
    embedding (K, N, V·E): each sample's gradient rows of the tokens it holds)."""
    k, n, t, o = s.shape
    if embedding:
        tokens = a.reshape(n, t)
        keep = (tokens >= 0).reshape(-1)
        samples = torch.arange(n, device=a.device).repeat_interleave(t)
        keys = (samples * shape[0] + tokens.reshape(-1))[keep]
        out = s.new_zeros(k, n * shape[0], o)
        out.index_add_(1, keys, s.reshape(k, n * t, o)[:, keep])
        return out.reshape(k, n, -1)
    if t == 1:
        return torch.einsum("kno,nd->knod", s[:, :, 0], a[:, 0]).reshape(k, n, -1)
    if torch.is_grad_enabled() and (a.requires_grad or s.requires_grad):
        pieces = [grads.transpose(0, 1) for grads in _per_sample_weight_gradients(a, s)]
        return torch.cat(pieces, dim=1).reshape(k, n, -1)
    # each chunk's batched product written in place: no copy of the rows (a transposed view)
    d = a.shape[-1]
    out = s.new_empty(n, k * o, d)
    for rows in sample_chunks(n, max(1, CHUNK_ELEMENTS // (k * o * d))):
        s_rows = s[:, rows].permute(1, 0, 3, 2).reshape(-1, k * o, t)
        torch.bmm(s_rows, a[rows], out=out[rows])
    return out.reshape(n, k, o * d).transpose(0, 1)


def weight_square_sums(a: Tensor, s: Tensor, embedding: bool, num_rows: int) -> Tensor:
    """``Σ_i (Σ_t s_kit a_itᵀ)²`` entrywise, per cotangent: (K, o, d) (for an embedding
    (K, V, E), the squared per-sample gradient rows of each token).

    One position: ``(s²)ᵀ(a²)``; else per-sample gradients a chunk at a time; for an embedding,
    per-sample sums over the positions of each (sample, token) pair.
    """
    k, n, t, o = s.shape
    if embedding:
        tokens = a.reshape(-1)
        keep = tokens >= 0
        samples = torch.arange(n, device=a.device).repeat_interleave(t)[keep]
        keys, inverse = torch.unique(samples * num_rows + tokens[keep], return_inverse=True)
        grouped = s.new_zeros(k, keys.numel(), o)
        grouped.index_add_(1, inverse, s.reshape(k, n * t, o)[:, keep])
        out = s.new_zeros(k, num_rows, o)
        return out.index_add_(1, keys % num_rows, grouped.square())
    d = a.shape[-1]
    if t == 1:
        return torch.einsum("kno,nd->kod", s[:, :, 0].square(), a[:, 0].square())
    totals = s.new_zeros(k, o, d)
    for grads in _per_sample_weight_gradients(a, s):
        totals += grads.square().sum(0)
    return totals


def kronecker_factors(
    a: Tensor | None,
    s: Tensor,
    embedding: bool,
    num_rows: int,
    input_factor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """KFC's sums over samples ``Σ_i Σ_t a aᵀ`` (an index count for embeddings; or
    ``input_factor`` when it is given, :meth:`KroneckerRule.input_factor`) and
    ``Σ_i (1/T) Σ_k Σ_t s sᵀ`` for the Fisher cotangents ``s`` (K', N, T, o)."""
    t = s.shape[2]
    flat_s = s.reshape(-1, s.shape[-1])
    g = flat_s.T @ flat_s / t
    if input_factor is not None:
        return g, input_factor
    if embedding:
        flat_a = a.reshape(-1)
        counts = torch.bincount(flat_a[flat_a >= 0], minlength=num_rows)
        return g, counts.to(s.dtype)
    flat_a = a.reshape(-1, a.shape[-1])
    return g, flat_a.T @ flat_a


def sample_chunks(size: int, per_chunk: int) -> Iterator[slice]:
    """Slices of at most ``per_chunk`` of ``size`` samples, in order."""
    for start in range(0, size, per_chunk):
        yield slice(start, min(size, start + per_chunk))
