"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` written out step by step, as functions of their weights.

PyTorch runs recurrent layers as one fused kernel, which :func:`torch.func.vmap` has no batching
rule for: per-sample gradients through it take one pass per sample. The same recursions written
with matrix products and elementwise gates batch like any other layer, so a layer rule can take
the per-sample gradients of a recurrent layer's weights with one ``vmap`` over the samples
(:class:`~lightning_flatness.core.module_rules.LocalRule`). The equations are PyTorch's own (its
documentation of each module), for any number of layers, either direction, with or without
biases, batch first or not, and an LSTM's projection ``proj_size``; dropout between layers is
that of evaluation mode (none), as in a measurement. A packed batch (``PackedSequence``) is
computed padded, each sample's recursion masked beyond its length.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

__all__ = [
    "factored_parameters",
    "joint_output",
    "packed_joint",
    "recurrent_forward",
    "split_joint",
    "split_packed_joint",
    "unrolls",
]


def unrolls(module: nn.Module, args: tuple) -> bool:
    """:func:`recurrent_forward` computes ``module(*args)``: a recurrent layer on a padded
    batch (not a packed sequence, not one unbatched sequence)."""
    return (
        isinstance(module, (nn.RNN, nn.LSTM, nn.GRU))
        and bool(args)
        and isinstance(args[0], Tensor)
        and args[0].dim() == 3
    )


def _cell(
    mode: str,
    x: Tensor,
    h: Tensor,
    c: Tensor | None,
    weights: list[Tensor | None],
    taps: tuple[Tensor, Tensor] | None = None,
):
    """One time step: the next hidden (and LSTM cell) state. ``taps`` (two zeros shaped like
    the gate pre-activations) are added to ``W_ih x + b_ih`` and ``W_hh h + b_hh``: their
    gradients are those of the two linear maps' outputs at this step."""
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    gates_x = x @ w_ih.T + (b_ih if b_ih is not None else 0)
    gates_h = h @ w_hh.T + (b_hh if b_hh is not None else 0)
    if taps is not None:
        gates_x, gates_h = gates_x + taps[0], gates_h + taps[1]
    if mode == "LSTM":
        i, f, g, o = (gates_x + gates_h).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h @ w_hr.T if w_hr is not None else h), c
    if mode == "GRU":
        x_r, x_z, x_n = gates_x.chunk(3, dim=-1)
        h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return (1 - z) * n + z * h, None
    pre = gates_x + gates_h
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


def recurrent_forward(
    module: nn.RNN | nn.LSTM | nn.GRU,
    params: dict[str, Tensor],
    input: Tensor,
    hx: Tensor | tuple[Tensor, Tensor] | None = None,
    lengths: Tensor | None = None,
    batch_first: bool | None = None,
    taps: dict[str, Tensor] | None = None,
    inputs: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
    """``module(input, hx)`` with the weights ``params`` (by attribute name; the module's own
    for those not given), step by step.

    ``taps`` (by weight name, e.g. ``weight_ih_l0``; each (steps, N, gates), zeros) are added
    to the outputs of the linear maps of those weights at every step, so their gradients are
    the maps' output gradients; ``inputs`` (a dict to fill) receives, by the same names, what
    each map was applied to, (steps, N, d): the layer's input ``x_t`` for ``weight_ih`` and the
    previous hidden state ``h_{t−1}`` for ``weight_hh``, zero beyond each sample's length.

    ``lengths`` (N,) makes it the module on the packed sequences of those lengths, padded: a
    sample's state stops changing after its last step (a reverse direction starts there) and its
    output is zero beyond it, as ``pad_packed_sequence`` of the packed output gives.
    ``batch_first`` overrides the module's layout of ``input`` and the output.

    Returns:
        ``(output, h_n)``, or ``(output, (h_n, c_n))`` for an LSTM, as the module returns them.
    """
    mode = module.mode
    lstm = mode == "LSTM"
    first = module.batch_first if batch_first is None else batch_first
    unbatched = input.dim() == 2
    x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if first else input)
    steps, batch = x.shape[0], x.shape[1]
    directions = 2 if module.bidirectional else 1
    proj = getattr(module, "proj_size", 0)
    out_size = proj if proj > 0 else module.hidden_size
    h0 = c0 = None
    if hx is not None:
        h0, c0 = hx if lstm else (hx, None)
        if unbatched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
    finals_h, finals_c = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            weights = [  # a weight not passed in is the module's own (as functional_call)
                params.get(f"{name}{suffix}", getattr(module, f"{name}{suffix}", None))
                for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
            ]
            index = layer * directions + direction
            h = h0[index] if h0 is not None else x.new_zeros(batch, out_size)
            c = None
            if lstm:
                c = c0[index] if c0 is not None else x.new_zeros(batch, module.hidden_size)
            order = range(steps) if direction == 0 else range(steps - 1, -1, -1)
            found: list[Tensor | None] = [None] * steps
            tap_ih = (taps or {}).get(f"weight_ih{suffix}")
            tap_hh = (taps or {}).get(f"weight_hh{suffix}")
            previous: list[Tensor | None] = [None] * steps
            for t in order:
                step_taps = None if tap_ih is None else (tap_ih[t], tap_hh[t])
                previous[t] = h
                if lengths is None:
                    h, c = _cell(mode, x[t], h, c, weights, step_taps)
                    found[t] = h
                    continue
                valid = (lengths > t).unsqueeze(-1)  # (N, 1): step t is inside the sequence
                previous[t] = torch.where(valid, h, torch.zeros_like(h))
                new_h, new_c = _cell(mode, x[t], h, c, weights, step_taps)
                h = torch.where(valid, new_h, h)
                c = torch.where(valid, new_c, c) if new_c is not None else None
                found[t] = torch.where(valid, new_h, torch.zeros_like(new_h))
            outputs.append(torch.stack(found))  # type: ignore[arg-type]
            if inputs is not None:
                inputs[f"weight_ih{suffix}"] = _within(x, lengths)
                inputs[f"weight_hh{suffix}"] = torch.stack(previous)  # type: ignore[arg-type]
            finals_h.append(h)
            if c is not None:
                finals_c.append(c)
        x = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
    output = x.squeeze(1) if unbatched else (x.transpose(0, 1) if first else x)
    h_n = torch.stack(finals_h)
    h_n = h_n.squeeze(1) if unbatched else h_n
    if not lstm:
        return output, h_n
    c_n = torch.stack(finals_c)
    return output, (h_n, c_n.squeeze(1) if unbatched else c_n)


def _within(x: Tensor, lengths: Tensor | None) -> Tensor:
    """``x`` (steps, N, d) with the steps beyond each sample's length zeroed."""
    if lengths is None:
        return x
    steps = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    return x * (steps < lengths.to(x.device)).unsqueeze(-1).to(x.dtype)


def factored_parameters(module: nn.RNNBase) -> dict[str, tuple[str, str]]:
    """For each parameter of a recurrent layer that is a linear map applied at every step, or
    its bias: ``{attribute: (weight it belongs to, "weight" or "bias")}``. Empty for an LSTM with
    a projection (``proj_size``), whose projection is no gate map: its parameters keep exact
    per-sample gradients."""
    if getattr(module, "proj_size", 0) > 0:
        return {}
    found = {}
    for attr, _ in module.named_parameters(recurse=False):
        kind, rest = attr.split("_", 1)  # weight_ih_l0 -> ("weight", "ih_l0")
        found[attr] = ("weight_" + rest, kind)
    return found


def _states(state: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return state if isinstance(state, tuple) else (state,)


def joint_output(
    module: nn.RNNBase, output: Tensor, state: Tensor | tuple, batch_first: bool | None = None
) -> Tensor:
    """Everything a batched recurrent layer returns, sample by sample: ``(N, total)``, each row
    a sample's output sequence followed by its final states, flattened. A model may read the
    output sequence, the final states or both; the gradient of this one tensor carries all of
    it. ``batch_first`` overrides the module's layout of ``output``."""
    first = module.batch_first if batch_first is None else batch_first
    sequence = output if first else output.transpose(0, 1)
    pieces = [sequence.flatten(1)] + [s.transpose(0, 1).flatten(1) for s in _states(state)]
    return torch.cat(pieces, dim=1)


def split_joint(
    module: nn.RNNBase,
    joint: Tensor,
    output: Tensor,
    state: Tensor | tuple,
    batch_first: bool | None = None,
) -> tuple[Tensor, Tensor | tuple[Tensor, ...]]:
    """``(output, state)`` shaped as the layer returned them, computed from ``joint``
    (:func:`joint_output`): the same values, now functions of ``joint``."""
    first = module.batch_first if batch_first is None else batch_first
    batch = joint.shape[0]
    sequence_shape = (output if first else output.transpose(0, 1)).shape
    states = _states(state)
    sizes = [joint.shape[1] - sum(s.numel() // batch for s in states)]
    sizes += [s.numel() // batch for s in states]
    parts = joint.split(sizes, dim=1)
    sequence = parts[0].reshape(sequence_shape)
    rebuilt = (sequence if first else sequence.transpose(0, 1)).contiguous()
    finals = tuple(
        part.reshape(batch, s.shape[0], *s.shape[2:]).transpose(0, 1).contiguous()
        for part, s in zip(parts[1:], states, strict=True)
    )
    return rebuilt, (finals if isinstance(state, tuple) else finals[0])


def packed_joint(module: nn.RNNBase, args: tuple, output: tuple) -> tuple[Tensor, tuple, Tensor]:
    """For a layer called on a ``PackedSequence``: the padded input (batch first, in the
    samples' own order) with its lengths, and :func:`joint_output` of the padded output."""
    packed_input, packed_output = args[0], output[0]
    padded, lengths = pad_packed_sequence(packed_input, batch_first=True)
    padded_output, _ = pad_packed_sequence(
        packed_output, batch_first=True, total_length=padded.shape[1]
    )
    joint = joint_output(module, padded_output, output[1], batch_first=True)
    return joint, (padded, *args[1:]), lengths


def split_packed_joint(
    module: nn.RNNBase, joint: Tensor, output: tuple
) -> tuple[PackedSequence, Tensor | tuple[Tensor, ...]]:
    """The layer's ``(PackedSequence, state)`` computed from ``joint`` (:func:`packed_joint`)."""
    packed = output[0]
    steps = len(packed.batch_sizes)
    batch = joint.shape[0]
    width = packed.data.shape[-1]
    padded_shape = torch.Size((batch, steps, width))
    padded, state = split_joint(
        module, joint, torch.empty(padded_shape, device="meta"), output[1], batch_first=True
    )
    order = packed.sorted_indices
    order = torch.arange(batch) if order is None else order.cpu()
    samples = torch.cat([order[: int(size)] for size in packed.batch_sizes])
    times = torch.repeat_interleave(torch.arange(steps), packed.batch_sizes)
    data = padded[samples.to(padded.device), times.to(padded.device)]
    rebuilt = PackedSequence(
        data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
    )
    return rebuilt, state
