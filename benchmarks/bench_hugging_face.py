"""The structures on real Hugging Face models: soft rank ÷ exact, and cost ÷ a training epoch.

Needs ``transformers`` (not a dependency of the package: ``pip install transformers``). Small
configurations of ``GPT2ForSequenceClassification`` (``Conv1D`` projections),
``DistilBertForSequenceClassification``, ``BertForSequenceClassification`` (dict batches with
padding in ``attention_mask``) and ``ViTForImageClassification`` are built from their configs
(random initialisation, nothing downloaded), trained with Adam and coupled weight decay λ on n
synthetic samples (the label is read from the first token, or from two image quadrants), and
measured in float64 on all n samples:

- the exact soft rank from the Gram matrix of the exact Fisher rows ``√p_c ∇θ log p_c``, one
  sample at a time (plain autograd: no vmap over the models' data-dependent mask code);
- ``measure()`` for the default (``auto``), ``kfac``, ``cg``, ``lanczos`` and ``hutchinson``;
- with ``--regularizer``, one step with ``SoftRankPenalty`` (batched, compositional) ÷ one
  plain step on a batch of 32.

Every cost is a ratio to one training epoch over the same n samples, timed in this run. Usage::

    python benchmarks/bench_hugging_face.py                 # n = 256, all four models
    python benchmarks/bench_hugging_face.py --models gpt2 --regularizer
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from _common import markdown_table, median, print_header, set_threads
from torch import Tensor, nn

from lightning_flatness import measure
from lightning_flatness.regularizer import PenaltyOptions, SoftRankPenalty

LAM = 1e-3
CLASSES = 4
LENGTH = 12
VOCAB = 50
STRUCTURES = ("auto", "kfac", "cg", "lanczos", "hutchinson")


def build(name: str) -> nn.Module:
    """A small configuration of the named model, randomly initialised."""
    import transformers as hf

    hf.logging.set_verbosity_error()
    common = {"vocab_size": VOCAB, "max_position_embeddings": LENGTH, "num_labels": CLASSES}
    if name == "gpt2":
        config = hf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=24,
            n_layer=2,
            n_head=2,
            num_labels=CLASSES,
            pad_token_id=0,
        )
        return hf.GPT2ForSequenceClassification(config)
    if name == "distilbert":
        config = hf.DistilBertConfig(dim=24, n_layers=2, n_heads=2, hidden_dim=48, **common)
        return hf.DistilBertForSequenceClassification(config)
    if name == "bert":
        config = hf.BertConfig(
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=48,
            **common,
        )
        return hf.BertForSequenceClassification(config)
    config = hf.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=1,
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        num_labels=CLASSES,
    )
    return hf.ViTForImageClassification(config)


def dataset(name: str, n: int, seed: int = 1) -> dict[str, Tensor]:
    """n samples as one dict: padded token ids with their mask, or 16×16 images."""
    generator = torch.Generator().manual_seed(seed)
    if name == "vit":
        images = torch.randn(n, 1, 16, 16, generator=generator, dtype=torch.float64)
        upper = images[:, 0, :8, :8].mean((1, 2)) > 0
        lower = images[:, 0, 8:, 8:].mean((1, 2)) > 0
        return {"pixel_values": images, "labels": upper.long() * 2 + lower.long()}
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=generator)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (n,), generator=generator)
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids[:, 0] % CLASSES}


def batches(data: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    n = len(data["labels"])
    return [{k: v[i : i + size] for k, v in data.items()} for i in range(0, n, size)]


def logits_of(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, data) -> float:
    """One epoch of Adam with coupled decay; its seconds."""
    start = time.perf_counter()
    model.train()
    for batch in batches(data, 32):
        optimizer.zero_grad()
        nn.functional.cross_entropy(logits_of(model, batch), batch["labels"]).backward()
        optimizer.step()
    model.eval()
    return time.perf_counter() - start


def exact_soft_rank(model: nn.Module, data: dict[str, Tensor]) -> float:
    """Tr(K(K+λI)⁻¹) of the Gram matrix K of the exact Fisher rows, one sample at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for batch in batches(data, 1):
        log_p = logits_of(model, batch)[0].log_softmax(-1)
        p = log_p.exp().detach()
        for c in range(CLASSES):
            grads = torch.autograd.grad(log_p[c], params, retain_graph=True)
            rows.append(p[c].sqrt() * torch.cat([g.reshape(-1) for g in grads]))
    stacked = torch.stack(rows)
    values = torch.linalg.eigvalsh(stacked @ stacked.T / len(data["labels"])).clamp_min(0)
    return float((values / (values + LAM)).sum())


def step_seconds(model: nn.Module, batch, penalty: SoftRankPenalty | None, repeats: int) -> float:
    """Median seconds of one training step (forward, loss [+ penalty], backward)."""
    times = []
    model.train()
    for _ in range(repeats):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(logits_of(model, batch), batch["labels"])
        if penalty is not None:
            loss = loss + penalty(model, {k: v for k, v in batch.items() if k != "labels"})
        loss.backward()
        model.zero_grad()
        times.append(time.perf_counter() - start)
    model.eval()
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,distilbert,bert,vit")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--regularizer", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    print_header("Hugging Face models: soft rank ÷ exact, cost ÷ one training epoch")
    rows, step_rows = [], []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build(name).double()
        data = dataset(name, args.samples)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=LAM)
        epochs = [train_epoch(model, optimizer, data) for _ in range(args.epochs)]
        epoch = median(epochs[-5:])
        exact = exact_soft_rank(model, data)
        size = sum(p.numel() for p in model.parameters())
        for structure in STRUCTURES:
            start = time.perf_counter()
            report = measure(
                model,
                batches(data, 32),
                lam=LAM,
                num_train_samples=args.samples,
                structure=structure,
            )
            cost = (time.perf_counter() - start) / epoch
            rows.append(
                [
                    name,
                    f"{size:,}",
                    f"{exact:.1f}",
                    report.structure,
                    f"{report.soft_rank / exact:.3f}",
                    f"{cost:.1f}",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
        if args.regularizer:
            batch = batches(data, 32)[0]
            plain = step_seconds(model, batch, None, 5)
            for estimator in ("batched", "compositional"):
                penalty = SoftRankPenalty(
                    lam=LAM,
                    num_train_samples=args.samples,
                    options=PenaltyOptions(estimator=estimator),
                )
                step_seconds(model, batch, penalty, 1)  # first call: checks and set-up
                ratio = step_seconds(model, batch, penalty, 5) / plain
                step_rows.append([name, estimator, f"{ratio:.1f}"])
                print(" | ".join(step_rows[-1]), flush=True)
    print()
    header = ["model", "P", "exact soft rank", "structure", "÷ exact", "time ÷ epoch"]
    print(markdown_table(header, rows))
    if step_rows:
        print()
        print(markdown_table(["model", "regularizer", "step ÷ plain step"], step_rows))


if __name__ == "__main__":
    main()
