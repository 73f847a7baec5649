"""fdl.bench.datasets against real-format files served by a real HTTP server on 127.0.0.1.

The files are built here in the published formats (IDX gz, the CIFAR-10 binary tar.gz, plain
text); ``CHECKSUMS`` is monkeypatched to their digests (the module's documented test seam).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import sys
import tarfile
import threading

import numpy as np
import pytest
import torch

from fdl.bench import datasets, fetch
from fdl.bench.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    MNIST_MEAN,
    MNIST_STD,
    NAMES,
    dataset_status,
    default_data_dir,
    load_dataset,
)
from fdl.errors import FdlError, UsageError

MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def idx_gz(array: np.ndarray) -> bytes:
    """``array`` (uint8) as a gzipped IDX file: magic 0x0000 08 <ndim>, big-endian dims."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def cifar_batch(labels: list[int], pixels: np.ndarray) -> bytes:
    """Records of 1 label byte + 3072 pixel bytes (R, G, B planes of 32x32)."""
    return b"".join(bytes([label]) + pixels[i].astype(np.uint8).tobytes()
                    for i, label in enumerate(labels))


def pin_checksum(monkeypatch, name: str, data: bytes, *, algorithm: str = "sha256") -> None:
    """Make CHECKSUMS expect exactly ``data`` for the dataset file ``name``."""
    monkeypatch.setitem(datasets.CHECKSUMS, name,
                        f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}")


def serve(http_server, monkeypatch, files: dict[str, bytes], *, algorithm: str = "sha256"):
    """Serve ``files`` under FDL_DATA_MIRROR and make CHECKSUMS expect exactly these bytes."""
    for name, data in files.items():
        http_server.files[name] = data
        pin_checksum(monkeypatch, name, data, algorithm=algorithm)
    monkeypatch.setenv("FDL_DATA_MIRROR", http_server.url(""))
    monkeypatch.setenv("FDL_ALLOW_HTTP", "1")  # the mirror is plain http on 127.0.0.1


@pytest.fixture
def mnist_files():
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte.gz": np.array([5, 0, 4, 1, 9], dtype=np.uint8),
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": np.array([7, 2, 1], dtype=np.uint8),
    }
    return arrays, {name: idx_gz(a) for name, a in arrays.items()}


def test_mnist_round_trips_pixels_and_labels_then_hits_the_cache(http_server, monkeypatch,
                                                                 tmp_path, mnist_files):
    arrays, files = mnist_files
    serve(http_server, monkeypatch, files, algorithm="md5")
    seen = []
    splits = load_dataset("mnist", data_dir=tmp_path, progress=lambda d, t: seen.append((d, t)))

    x, y = splits.train.tensors
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [5, 0, 4, 1, 9]
    pixels = (x * MNIST_STD + MNIST_MEAN) * 255
    assert torch.allclose(pixels[:, 0], torch.from_numpy(arrays[MNIST_FILES[0]]).float(), atol=1e-3)
    tx, ty = splits.test.tensors
    assert tx.shape == (3, 1, 28, 28) and ty.tolist() == [7, 2, 1]
    assert splits.meta == {"input_shape": (1, 28, 28), "num_classes": 10, "vocab_size": None,
                           "source": "downloaded", "path": str(tmp_path / "mnist")}
    assert seen[-1] == (len(files[MNIST_FILES[-1]]), len(files[MNIST_FILES[-1]]))
    assert sorted(r["path"] for r in http_server.requests) == sorted(f"/{f}" for f in files)

    again = load_dataset("mnist", data_dir=tmp_path, download=False)
    assert len(http_server.requests) == 4  # no second request for any file
    assert again.meta["source"] == "cache"
    assert torch.equal(again.train.tensors[0], x)
    assert dataset_status("mnist", data_dir=tmp_path) == "cached"


def test_normalisation_maps_the_dataset_mean_to_zero(http_server, monkeypatch, tmp_path):
    # images whose every pixel is the MNIST mean (x 255) normalise to ~0; 0 and 255 to the ends
    mean_pixel = round(MNIST_MEAN * 255)
    images = np.stack([np.full((28, 28), mean_pixel), np.zeros((28, 28)), np.full((28, 28), 255)])
    files = {MNIST_FILES[0]: idx_gz(images), MNIST_FILES[1]: idx_gz(np.array([1, 2, 3])),
             MNIST_FILES[2]: idx_gz(images[:1]), MNIST_FILES[3]: idx_gz(np.array([4]))}
    serve(http_server, monkeypatch, files)
    x = load_dataset("mnist", data_dir=tmp_path).train.tensors[0]
    assert abs(x[0].mean().item()) < 0.5 / 255 / MNIST_STD
    assert x[1].unique().tolist() == pytest.approx([-MNIST_MEAN / MNIST_STD])
    assert x[2].unique().tolist() == pytest.approx([(1 - MNIST_MEAN) / MNIST_STD])


def test_a_file_that_is_not_idx_is_refused(http_server, monkeypatch, tmp_path, mnist_files):
    _, files = mnist_files
    files = {**files, MNIST_FILES[1]: gzip.compress(b"\x00\x00\x08\x03" + bytes(12))}
    serve(http_server, monkeypatch, files)
    with pytest.raises(FdlError, match=r"not an IDX file.*0x00000801"):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.fixture
def cifar_archive():
    rng = np.random.default_rng(2)
    batches, labels = {}, []
    for i, name in enumerate([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]):
        pixels = rng.integers(0, 256, size=(2 + i % 2, 3, 32, 32), dtype=np.uint8)
        batch_labels = [(i + j) % 10 for j in range(len(pixels))]
        batches[name] = (batch_labels, pixels)
        labels += batch_labels
    members = {f"cifar-10-batches-bin/{n}": cifar_batch(*v) for n, v in batches.items()}
    members["cifar-10-batches-bin/batches.meta.txt"] = b"airplane\nautomobile\n"
    return batches, tar_gz(members)


def test_cifar10_round_trips_planes_labels_and_split(http_server, monkeypatch, tmp_path,
                                                     cifar_archive):
    batches, archive = cifar_archive
    serve(http_server, monkeypatch, {"cifar-10-binary.tar.gz": archive}, algorithm="md5")
    splits = load_dataset("cifar10", data_dir=tmp_path)

    train_parts = [batches[f"data_batch_{k}.bin"] for k in range(1, 6)]
    want_pixels = np.concatenate([p for _, p in train_parts])
    want_labels = [label for labels, _ in train_parts for label in labels]
    x, y = splits.train.tensors
    assert x.shape == (len(want_labels), 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == want_labels
    mean = torch.tensor(CIFAR10_MEAN).reshape(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).reshape(1, 3, 1, 1)
    assert torch.allclose((x * std + mean) * 255, torch.from_numpy(want_pixels).float(), atol=1e-3)
    test_labels, test_pixels = batches["test_batch.bin"]
    assert splits.test.tensors[1].tolist() == test_labels
    assert torch.allclose((splits.test.tensors[0] * std + mean) * 255,
                          torch.from_numpy(test_pixels).float(), atol=1e-3)
    assert splits.meta["input_shape"] == (3, 32, 32) and splits.meta["num_classes"] == 10
    extracted = sorted(p.name for p in (tmp_path / "cifar10" / "cifar-10-batches-bin").iterdir())
    assert extracted == sorted(batches)  # only the six batches, no staging left behind
    assert not list((tmp_path / "cifar10").glob(".extract-*"))


@pytest.mark.parametrize("bad_name", ["../escape.bin", "/tmp/absolute.bin",
                                      "cifar-10-batches-bin/../../escape.bin"])
def test_cifar10_archive_with_unsafe_member_is_refused(http_server, monkeypatch, tmp_path,
                                                       cifar_archive, bad_name):
    batches, _ = cifar_archive
    members = {f"cifar-10-batches-bin/{n}": cifar_batch(*v) for n, v in batches.items()}
    members[bad_name] = b"x"
    serve(http_server, monkeypatch, {"cifar-10-binary.tar.gz": tar_gz(members)})
    with pytest.raises(FdlError, match="unsafe member"):
        load_dataset("cifar10", data_dir=tmp_path / "data")
    assert not (tmp_path / "escape.bin").exists() and not (tmp_path / "data/escape.bin").exists()
    assert not (tmp_path / "data/cifar10/cifar-10-batches-bin").exists()


def test_cifar10_archive_without_every_batch_is_refused(http_server, monkeypatch, tmp_path,
                                                        cifar_archive):
    batches, _ = cifar_archive
    members = {f"cifar-10-batches-bin/{n}": cifar_batch(*v) for n, v in batches.items()
               if n != "test_batch.bin"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:  # a link where a batch should be
        link = tarfile.TarInfo("cifar-10-batches-bin/test_batch.bin")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    serve(http_server, monkeypatch, {"cifar-10-binary.tar.gz": buffer.getvalue()})
    with pytest.raises(FdlError, match=r"lacks test_batch\.bin under cifar-10-batches-bin/"):
        load_dataset("cifar10", data_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "cifar10").iterdir()) == [
        ".cifar-10-binary.tar.gz.verified", ".lock", "cifar-10-binary.tar.gz"]


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 7


def test_shakespeare_vocab_split_and_windows(http_server, monkeypatch, tmp_path):
    serve(http_server, monkeypatch, {"input.txt": TEXT.encode()})
    splits = load_dataset("shakespeare", data_dir=tmp_path, seq_len=16)

    vocab = sorted(set(TEXT))
    ids = [vocab.index(c) for c in TEXT]
    cut = int(len(TEXT) * 0.9)
    x, y = splits.train.tensors
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == ((cut - 1) // 16, 16)
    assert x[0].tolist() == ids[:16] and y[0].tolist() == ids[1:17]
    assert x[3].tolist() == ids[48:64] and y[3].tolist() == ids[49:65]  # stride = seq_len
    tx, ty = splits.test.tensors
    assert tx.shape == ((len(TEXT) - cut - 1) // 16, 16)
    assert tx[0].tolist() == ids[cut:cut + 16] and ty[0].tolist() == ids[cut + 1:cut + 17]
    assert splits.meta["vocab_size"] == len(vocab) and splits.meta["num_classes"] is None
    assert splits.meta["input_shape"] == (16,)
    with pytest.raises(UsageError, match="seq_len 200 is too long for shakespeare's test split"):
        load_dataset("shakespeare", data_dir=tmp_path, seq_len=200)


def test_checksum_mismatch_names_the_file_and_leaves_nothing(http_server, monkeypatch,
                                                            tmp_path):
    serve(http_server, monkeypatch, {"input.txt": TEXT.encode()})
    monkeypatch.setitem(datasets.CHECKSUMS, "input.txt", "md5:" + "0" * 32)
    with pytest.raises(FdlError) as caught:
        load_dataset("shakespeare", data_dir=tmp_path, seq_len=8)
    got = hashlib.md5(TEXT.encode()).hexdigest()
    assert caught.value.message == (f"checksum mismatch for {http_server.url('input.txt')}: "
                                    f"expected md5 {'0' * 32}, got {got}")
    assert [p.name for p in (tmp_path / "shakespeare").iterdir() if p.name != ".lock"] == []
    assert dataset_status("shakespeare", data_dir=tmp_path) == "downloadable"


def test_canonical_urls_fall_back_to_the_next_base(http_server, monkeypatch, tmp_path):
    serve(http_server, monkeypatch, {"input.txt": TEXT.encode()})
    monkeypatch.delenv("FDL_DATA_MIRROR")
    monkeypatch.setitem(datasets.BASE_URLS, "shakespeare",
                        (http_server.url("down/"), http_server.url("")))
    splits = load_dataset("shakespeare", data_dir=tmp_path, seq_len=8)
    assert splits.meta["source"] == "downloaded"
    assert [r["path"] for r in http_server.requests] == ["/down/input.txt", "/input.txt"]


def test_every_base_failing_is_one_error_naming_each(http_server, monkeypatch, tmp_path):
    http_server.files["input.txt"] = TEXT.encode()
    monkeypatch.setitem(datasets.BASE_URLS, "shakespeare",
                        (http_server.url("a/"), http_server.url("b/"), "ftp://127.0.0.1/"))
    monkeypatch.delenv("FDL_DATA_MIRROR", raising=False)
    monkeypatch.setenv("FDL_ALLOW_HTTP", "1")
    with pytest.raises(FdlError) as caught:
        load_dataset("shakespeare", data_dir=tmp_path)
    assert caught.value.message == (
        f"download failed: HTTP 404 for {http_server.url('a/input.txt')}; "
        f"HTTP 404 for {http_server.url('b/input.txt')}; "
        "URL 'ftp://127.0.0.1/input.txt' has scheme 'ftp'; allowed: https, file, http (with "
        "FDL_ALLOW_HTTP=1)")
    assert "FDL_DATA_MIRROR" in caught.value.hint
    assert len(http_server.requests) == 2  # a 404 rules a URL out: no retries
    assert [p.name for p in (tmp_path / "shakespeare").iterdir()] == [".lock"]


def test_a_mirror_cutting_the_connection_is_resumed_from_the_next(http_server, monkeypatch,
                                                                  tmp_path):
    serve(http_server, monkeypatch, {"input.txt": TEXT.encode()}, algorithm="md5")
    monkeypatch.delenv("FDL_DATA_MIRROR")
    monkeypatch.setitem(datasets.BASE_URLS, "shakespeare",
                        (http_server.url("cut/"), http_server.url("")))
    http_server.files["cut/input.txt"] = TEXT.encode()
    http_server.script.append(http_server.Act(cut_after=100))
    splits = load_dataset("shakespeare", data_dir=tmp_path, seq_len=8)
    assert splits.meta["source"] == "downloaded"
    assert (tmp_path / "shakespeare" / "input.txt").read_text() == TEXT
    assert http_server.requests == [{"path": "/cut/input.txt", "range": None},
                                    {"path": "/input.txt", "range": "bytes=100-"}]


def test_a_file_url_mirror_is_copied_and_verified(monkeypatch, tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "input.txt").write_text(TEXT)
    pin_checksum(monkeypatch, "input.txt", TEXT.encode())
    monkeypatch.setenv("FDL_DATA_MIRROR", mirror.as_uri())
    splits = load_dataset("shakespeare", data_dir=tmp_path / "data", seq_len=8)
    assert splits.meta["source"] == "downloaded"
    assert sorted(p.name for p in (tmp_path / "data" / "shakespeare").iterdir()) == [
        ".input.txt.verified", ".lock", "input.txt"]


def test_offline_without_cache_says_what_to_do_and_creates_nothing(tmp_path):
    with pytest.raises(FdlError, match="dataset mnist is not in the cache") as caught:
        load_dataset("mnist", data_dir=tmp_path / "data", download=False)
    assert "downloading allowed" in caught.value.hint
    assert not (tmp_path / "data").exists()


def test_file_copied_in_by_hand_is_verified_once(tmp_path, monkeypatch):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    (folder / "input.txt").write_text(TEXT)
    pin_checksum(monkeypatch, "input.txt", TEXT.encode())
    splits = load_dataset("shakespeare", data_dir=tmp_path, download=False, seq_len=8)
    assert splits.meta["source"] == "cache"
    assert (folder / ".input.txt.verified").is_file()

    (folder / "input.txt").write_text(TEXT.upper())  # a different size: the marker is stale
    with pytest.raises(FdlError, match=r"cached file .*input\.txt does not match its checksum"):
        load_dataset("shakespeare", data_dir=tmp_path, download=False, seq_len=8)


def test_concurrent_loads_download_each_file_once(http_server, monkeypatch, tmp_path,
                                                  mnist_files):
    _, files = mnist_files
    serve(http_server, monkeypatch, files)
    http_server.default = http_server.Act(delay_s=0.05)
    results, errors = [], []

    def load() -> None:
        try:
            results.append(load_dataset("mnist", data_dir=tmp_path))
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == [] and len(results) == 3
    assert len(http_server.requests) == 4
    assert sorted(r.meta["source"] for r in results) == ["cache", "cache", "downloaded"]


def test_digits_shapes_normalisation_and_fixed_split(tmp_path):
    splits = load_dataset("digits", data_dir=tmp_path)
    x, y = splits.train.tensors
    assert x.shape == (1438, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert splits.test.tensors[0].shape == (359, 1, 8, 8)
    assert abs(x.mean().item()) < 1e-5 and x.std().item() == pytest.approx(1, abs=1e-3)
    assert sorted(set(y.tolist())) == list(range(10))
    again = load_dataset("digits", data_dir=tmp_path)
    assert torch.equal(again.test.tensors[0], splits.test.tensors[0])
    assert torch.equal(again.test.tensors[1], splits.test.tensors[1])
    assert splits.meta == {"input_shape": (1, 8, 8), "num_classes": 10, "vocab_size": None,
                           "source": "bundled", "path": None}
    assert not tmp_path.joinpath("digits").exists()


def test_digits_without_scikit_learn(tmp_path, monkeypatch):
    # A package that is not installed, as Python sees one: importing it (and find_spec) fails.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert dataset_status("digits", data_dir=tmp_path) == (
        "unavailable: scikit-learn is not installed (pip install 'fdl[bench]')")
    with pytest.raises(FdlError, match="needs scikit-learn") as caught:
        load_dataset("digits", data_dir=tmp_path)
    assert caught.value.hint == "pip install 'fdl[bench]'"


def test_synthetic_is_deterministic_and_learnable(tmp_path):
    splits = load_dataset("synthetic", data_dir=tmp_path)
    x, y = splits.train.tensors
    tx, ty = splits.test.tensors
    assert x.shape == (16384, 1, 8, 8) and tx.shape == (2048, 1, 8, 8)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert sorted(set(y.tolist())) == list(range(10))
    again = load_dataset("synthetic", data_dir=tmp_path)
    assert torch.equal(again.train.tensors[0], x) and torch.equal(again.test.tensors[1], ty)
    # nearest class mean: well above chance (0.1), short of perfect
    means = torch.stack([x[y == c].mean(0) for c in range(10)]).reshape(10, -1)
    accuracy = (torch.cdist(tx.reshape(len(tx), -1), means).argmin(1) == ty).float().mean()
    assert 0.8 < accuracy.item() < 0.99
    assert splits.meta["source"] == "generated" and splits.meta["path"] is None


def test_status_of_each_dataset_without_network(tmp_path):
    statuses = {name: dataset_status(name, data_dir=tmp_path) for name in NAMES}
    assert statuses == {"mnist": "downloadable", "cifar10": "downloadable",
                        "shakespeare": "downloadable", "digits": "bundled",
                        "synthetic": "generated"}


def test_unknown_name_lists_the_allowed_ones(tmp_path):
    allowed = "mnist, cifar10, shakespeare, digits, synthetic"
    with pytest.raises(UsageError, match=f"unknown dataset 'imagenet'; choose one of: {allowed}"):
        load_dataset("imagenet", data_dir=tmp_path)
    with pytest.raises(UsageError) as caught:
        dataset_status("imagenet", data_dir=tmp_path)
    assert caught.value.exit_code == 2


def test_default_data_dir_is_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FDL_CACHE_DIR", str(tmp_path / "cache"))
    assert default_data_dir() == tmp_path / "cache" / "datasets"


@pytest.mark.network
def test_real_mnist_labels_match_the_published_md5(tmp_path, monkeypatch):
    monkeypatch.delenv("FDL_DATA_MIRROR", raising=False)
    dest = tmp_path / "t10k-labels-idx1-ubyte.gz"
    fetch.download(datasets._urls("mnist", dest.name), dest,
                   expected=datasets.CHECKSUMS[dest.name], progress=None)
    labels = datasets._read_idx(dest, magic=0x00000801)
    assert labels.shape == (10000,) and labels[:3].tolist() == [7, 2, 1]
