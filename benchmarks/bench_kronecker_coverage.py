"""Linear maps inside modules: ``kfac`` ÷ exact with and without their Kronecker factors.

Recurrent gate weights (``nn.LSTM``, ``nn.GRU``) and the projections of a self-attention
``nn.MultiheadAttention`` are linear maps applied at every step or position, which ``kfac``
factors like a linear layer's weight. Before, it gave them exact diagonal blocks. Each model is
trained on synthetic data, then measured once with the default (``probe_kernel``: the exact
rows for the recurrent models' 4 classes; for the ViT's 10, 4 probes with the jackknife, within
1% of exact on the sweeps), once with ``kfac`` and once with ``diag``; "diagonals" is ``kfac``
with the blocks of those weights replaced by their exact diagonals (from ``diag``), which is
what ``kfac`` gave them before: both from the same run. Usage::

    python benchmarks/bench_kronecker_coverage.py [--threads 2] [--n 512] [--epochs 3 30]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from _common import markdown_table, print_header, set_threads
from torch import Tensor, nn

from lightning_flatness import measure

LAM = 1e-4


class Recurrent(nn.Module):
    """Tokens → embedding → two-layer bidirectional LSTM/GRU → head on the last step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        layer = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = layer(16, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 4)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out[:, -1])


class ViT(nn.Module):
    """28×28 images → 7×7 patches → class token → two encoder layers (torch's
    ``nn.TransformerEncoderLayer``, self-attention) → head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, width, 7, 7)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(0.02 * torch.randn(1, 17, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(width, 10)

    def forward(self, images: Tensor) -> Tensor:
        tokens = self.patch(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], 1) + self.pos
        return self.head(self.encoder(tokens)[:, 0])


def _data(name: str, n: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        labels = torch.randint(0, 10, (n,), generator=generator)
        images = torch.randn(n, 1, 28, 28, generator=generator)
        return images + 0.1 * labels.view(-1, 1, 1, 1).float(), labels
    tokens = torch.randint(0, 50, (n, 12), generator=generator)
    return tokens, tokens[:, :3].sum(1) % 4


def _inside(model: nn.Module) -> list[str]:
    """The weights of linear maps inside recurrent and attention modules."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.LSTM, nn.GRU)):
            weights = [attr for attr, _ in module.named_parameters() if "weight" in attr]
            names += [f"{prefix}.{attr}" for attr in weights]
        elif isinstance(module, nn.MultiheadAttention):
            names += [f"{prefix}.in_proj_weight", f"{prefix}.out_proj.weight"]
    return names


def _diagonal_soft_ranks(model: nn.Module, diagonal: Tensor) -> dict[str, float]:
    """Each parameter's soft rank of its exact diagonal (``diag``'s values, in parameter
    order)."""
    found, start = {}, 0
    for name, param in model.named_parameters():
        values = diagonal[start : start + param.numel()].double()
        found[name] = float((values / (values + LAM)).sum())
        start += param.numel()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--epochs", type=int, nargs="+", default=[3, 30])
    args = parser.parse_args()
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    print_header(f"kfac on linear maps inside modules (n = {args.n}, λ = {LAM})")
    rows = []
    builders = {"LSTM": lambda: Recurrent("lstm"), "GRU": lambda: Recurrent("gru"), "ViT": ViT}
    for label, build in builders.items():
        inputs, targets = _data("vit" if label == "ViT" else "text", args.n)
        for epochs in args.epochs:
            torch.manual_seed(0)
            model = build()
            optimizer = torch.optim.Adam(model.parameters(), 3e-3, weight_decay=LAM)
            for _ in range(epochs):
                for i in range(0, args.n, 64):
                    optimizer.zero_grad()
                    logits = model(inputs[i : i + 64])
                    nn.functional.cross_entropy(logits, targets[i : i + 64]).backward()
                    optimizer.step()
            model.eval()
            data = [(inputs[i : i + 64], targets[i : i + 64]) for i in range(0, args.n, 64)]
            options = {"lam": LAM, "num_train_samples": args.n}
            exact = measure(model, data, **options).soft_rank
            kfac = measure(model, data, structure="kfac", **options)
            diag = measure(model, data, structure="diag", **options)
            inside = _inside(model)
            assert all(kfac.coverage[name] == "kronecker" for name in inside), kfac.coverage
            diagonal = _diagonal_soft_ranks(model, diag.eigenvalues)
            before = kfac.soft_rank + sum(
                diagonal[name] - kfac.blocks[name].soft_rank for name in inside
            )
            rows.append(
                [
                    label,
                    str(epochs),
                    f"{exact:,.1f}",
                    f"{before / exact:.2f}",
                    f"{kfac.soft_rank / exact:.2f}",
                ]
            )
            print(f"<!-- {label} after {epochs} epochs done -->", flush=True)
    header = ["model", "epochs", "exact soft rank", "kfac ÷ exact, diagonals", "kfac ÷ exact, now"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
