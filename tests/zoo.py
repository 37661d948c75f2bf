"""Small models written the way practitioners write them, for the any-architecture tests.

Each builder returns ``(model, inputs, targets)`` in float64: a tiny instance whose dense
P × P Fisher the reference can still form. Nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ZOO", "build", "zoo_data"]


class FunctionalCNN(nn.Module):
    """A CNN whose forward uses ``F.relu`` and ``F.max_pool2d`` (the common way to write one)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 2 * 2, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet with BatchNorm, skip connections, in-place ReLUs and Dropout."""

    def __init__(self, width: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)
        )
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(self.dropout(x))


class TextTransformer(nn.Module):
    """Token classifier: embedding, positional slice, ``nn.TransformerEncoderLayer`` with a
    padding mask, masked mean pooling; called with keywords from dict batches."""

    def __init__(self, vocab: int = 11, dim: int = 8, max_len: int = 6, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Parameter(0.1 * torch.randn(1, max_len, dim))
        self.encoder = nn.TransformerEncoderLayer(
            dim, nhead=2, dim_feedforward=12, dropout=0.1, batch_first=True
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos[:, :length]
        padding = input_ids == 0 if attention_mask is None else attention_mask == 0
        x = self.encoder(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1).clamp_min(1.0))


class TinyViT(nn.Module):
    """ViT-style: convolutional patch embedding, class token, positional embedding,
    ``nn.TransformerEncoder`` (sequence-first), LayerNorm and a head on the class token."""

    def __init__(self, dim: int = 8, patch: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.patches = nn.Conv2d(1, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=10, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        tokens = torch.cat([cls, tokens], dim=1) + self.pos
        tokens = self.encoder(tokens.transpose(0, 1)).transpose(0, 1)
        return self.head(self.norm(tokens[:, 0]))


class TiedMLP(nn.Module):
    """An MLP that applies one layer twice, ties another layer's weight to it, and uses its
    head's weight a second time outside the head (``F.linear``)."""

    def __init__(self, features: int = 6, hidden: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.encode = nn.Linear(features, hidden)
        self.shared = nn.Linear(hidden, hidden)
        self.tied = nn.Linear(hidden, hidden, bias=False)
        self.tied.weight = self.shared.weight
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.encode(x))
        h = torch.tanh(self.shared(h)) + h
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.tied(h))
        return self.head(h) + 0.5 * F.linear(h, self.head.weight)


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 projection as that library defines it: ``y = x W + b`` with the
    weight stored (in, out), applied through ``torch.addmm``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(nf))

    def forward(self, x: Tensor) -> Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class TinyGPT2(nn.Module):
    """GPT-2 for sequence classification, written as its library writes it: token and position
    embeddings, a pre-norm block with ``Conv1D`` attention (causal and padding masks) and MLP
    projections, and a bias-free score head read at each sequence's last non-padding token.
    Takes ``{"input_ids", "attention_mask"}``; like the library's mask code, its control flow
    depends on the data (the padding mask is applied only when some token is padding), which
    ``vmap`` over samples cannot follow."""

    def __init__(self, vocab: int = 11, width: int = 8, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(6, width)
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = Conv1D(3 * width, width)
        self.attn_proj = Conv1D(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = Conv1D(2 * width, width)
        self.mlp_proj = Conv1D(width, 2 * width)
        self.ln_f = nn.LayerNorm(width)
        self.score = nn.Linear(width, classes, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None]  # (1, T), as the library
        h = self.wte(input_ids) + self.wpe(positions)
        q, k, v = self.c_attn(self.ln_1(h)).split(h.shape[-1], dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        allowed = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
        if bool((attention_mask == 0).any()):  # data-dependent, as the library's mask code
            allowed = allowed & attention_mask[:, None, None, :].bool()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
        h = h + self.attn_proj(attended)
        h = h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h))))
        logits = self.score(self.ln_f(h))
        last = attention_mask.sum(1) - 1
        return logits[torch.arange(batch, device=h.device), last]


class RecurrentClassifier(nn.Module):
    """Token classifier: embedding, a two-layer bidirectional ``nn.LSTM`` (batch first), and a
    head on the last time step (PyTorch's fused recurrent kernel)."""

    def __init__(self, vocab: int = 11, width: int = 4, hidden: int = 3, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out[:, -1])


def _images(n: int, size: int, generator: torch.Generator) -> Tensor:
    return torch.randn(n, 1, size, size, generator=generator, dtype=torch.float64)


def _tokens(n: int, generator: torch.Generator) -> Tensor:
    ids = torch.randint(1, 11, (n, 6), generator=generator)
    lengths = torch.randint(2, 7, (n,), generator=generator)
    return ids.masked_fill(torch.arange(6) >= lengths.unsqueeze(1), 0)


def _trained_batch_norm(model: nn.Module, inputs: Tensor) -> nn.Module:
    """Give BatchNorm layers non-trivial running statistics (as after training)."""
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(inputs)
    return model.eval()


def build(name: str, seed: int = 0) -> nn.Module:
    """A fresh float64 zoo model (eval mode)."""
    torch.manual_seed(seed)
    if name == "compiled":
        return torch.compile(TiedMLP(features=49).double())
    model = {
        "functional_cnn": FunctionalCNN,
        "resnet": ResNet,
        "transformer": TextTransformer,
        "vit": TinyViT,
        "tied_mlp": lambda: TiedMLP(features=49),
        "gpt2": TinyGPT2,
        "lstm": RecurrentClassifier,
    }[name]().double()
    if name == "resnet":
        generator = torch.Generator().manual_seed(seed + 7)
        _trained_batch_norm(model, _images(16, 8, generator))
    return model.eval()


def zoo_data(name: str, n: int, seed: int = 1) -> tuple[object, Tensor]:
    """Inputs (a tensor, or ``{"input_ids": ...}`` for the text model) and targets."""
    generator = torch.Generator().manual_seed(seed)
    if name == "transformer":
        return {"input_ids": _tokens(n, generator)}, torch.randint(0, 3, (n,), generator=generator)
    if name == "gpt2":
        ids = _tokens(n, generator)
        inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
        return inputs, torch.randint(0, 3, (n,), generator=generator)
    if name == "lstm":
        return _tokens(n, generator), torch.randint(0, 3, (n,), generator=generator)
    classes = {"functional_cnn": 5, "resnet": 4}.get(name, 3)
    if name in ("tied_mlp", "compiled"):
        inputs = torch.randn(n, 49, generator=generator, dtype=torch.float64)
    else:
        inputs = _images(n, 8, generator)
    return inputs, torch.randint(0, classes, (n,), generator=generator)


ZOO = ("functional_cnn", "resnet", "transformer", "vit", "tied_mlp", "compiled", "gpt2", "lstm")
