"""The datasets of ``fdl bench``, each loaded as a pair of torch ``TensorDataset``s.

* ``mnist``: 60000/10000 handwritten digits, float32 [N,1,28,28], from the four IDX gz files
  (md5s as torchvision lists them);
* ``cifar10``: 50000/10000 images, float32 [N,3,32,32], from the Toronto binary tar.gz (its md5);
* ``shakespeare``: tiny-shakespeare from karpathy/char-rnn's ``input.txt`` (sha256), int64
  ``(x, y)`` windows;
* ``digits``: scikit-learn's bundled 8x8 digits (the ``fdl[bench]`` extra), float32 [N,1,8,8],
  a seeded 80/20 split (1438/359);
* ``synthetic``: 16384/2048 samples shaped like digits, generated offline from a fixed seed.

Labels are int64 class indices. Images are normalised ``(x/255 - mean) / std`` with the usual
constants (``MNIST_MEAN`` ...); digits are scaled to 0..1 and normalised with their training
split's mean/std. Shakespeare's vocabulary is the sorted set of characters in the whole text;
the first 90% of the text is the training split, the rest the test split, cut into
non-overlapping windows of ``seq_len`` with ``y`` = ``x`` shifted by one character.

Downloads land in ``data_dir/<name>/`` (``default_data_dir()``: ``<cache>/datasets``), each
file fetched from the ``BASE_URLS`` in order and renamed into place only when its checksum
matches ``CHECKSUMS`` (a mismatch is an ``FdlError`` naming the URL and both digests), then
remembered as verified so later loads neither download nor re-hash it (:mod:`fdl.bench.fetch`).
A lock on ``data_dir/<name>/.lock`` lets several workers load the same dataset at once: one
downloads, the others wait and read the cache.

``FDL_DATA_MIRROR`` replaces the canonical URLs with ``$FDL_DATA_MIRROR/<file name>`` (air-gapped
sites, tests; a ``file:///`` folder works too). ``CHECKSUMS`` is a module-level dict so that
tests serving home-made files can ``monkeypatch.setitem`` the digests they expect: that is the
test seam, not a user setting.

Example::

    splits = load_dataset("mnist", data_dir=default_data_dir())
    image, label = splits.train[0]        # float32 [1, 28, 28], int64 scalar
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fdl import console, paths
from fdl.bench import fetch
from fdl.download.fetch import Progress
from fdl.errors import FdlError, UsageError

NAMES = ("mnist", "cifar10", "shakespeare", "digits", "synthetic")

# file name -> "algorithm:hex digest". MNIST: torchvision's MNIST.resources; CIFAR-10: the md5
# on https://www.cs.toronto.edu/~kriz/cifar.html; tiny-shakespeare: tensorflow_datasets'
# url_checksums/tiny_shakespeare.txt (1115394 bytes). Tests monkeypatch entries (see above).
CHECKSUMS: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "md5:f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "md5:d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "md5:9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "md5:ec29112dd5afa0611ce80d1b7f02629c",
    "cifar-10-binary.tar.gz": "md5:c32a1d4ab5d03f1284b67883e8d87530",
    "input.txt": "sha256:86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
}

# dataset -> the base URLs its files are fetched from, tried in order (yann.lecun.com is often
# down, so torchvision's S3 copy goes first).
BASE_URLS: dict[str, tuple[str, ...]] = {
    "mnist": ("https://ossci-datasets.s3.amazonaws.com/mnist/",
              "http://yann.lecun.com/exdb/mnist/"),
    "cifar10": ("https://www.cs.toronto.edu/~kriz/",),
    "shakespeare": ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                    "tinyshakespeare/",),
}

_FILES: dict[str, tuple[str, ...]] = {
    "mnist": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
              "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
    "cifar10": ("cifar-10-binary.tar.gz",),
    "shakespeare": ("input.txt",),
}

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)  # population std of the training set, per channel
_CIFAR_DIR = "cifar-10-batches-bin"
_CIFAR_BATCHES = (*(f"data_batch_{i}.bin" for i in range(1, 6)), "test_batch.bin")
_CIFAR_RECORD = 1 + 3 * 32 * 32
_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801
_DIGITS_SPLIT_SEED = 0
_SYNTHETIC_SEED = 0
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Splits:
    """One dataset's train and test splits plus what a model needs to know about them."""

    name: str
    train: TensorDataset
    test: TensorDataset
    meta: dict  # input_shape, num_classes, vocab_size, source, path (see load_dataset)


def default_data_dir() -> Path:
    """Where downloaded datasets are cached: ``<fdl cache dir>/datasets``."""
    return paths.cache_dir() / "datasets"


def load_dataset(name: str, *, data_dir: Path, download: bool = True, seq_len: int = 128,
                 progress: Progress | None = None) -> Splits:
    """Load ``name`` (one of ``NAMES``), downloading into ``data_dir/<name>`` if allowed.

    ``meta``: ``input_shape`` ((C,H,W) or (seq_len,)), ``num_classes`` (None for text),
    ``vocab_size`` (text only), ``source`` ("downloaded" | "cache" | "bundled" | "generated"),
    ``path`` (the dataset's folder, or None). ``progress(bytes_done, total_or_None)`` is called
    per file while downloading. Raises ``UsageError`` for a bad name or ``seq_len``,
    ``FdlError`` for a failed download, a checksum mismatch or (``download=False``) a dataset
    not in the cache.
    """
    _check_name(name)
    if name == "digits":
        return _digits()
    if name == "synthetic":
        return _synthetic()
    if seq_len < 1:
        raise UsageError(f"seq_len must be a positive number of characters, got {seq_len}")
    folder = Path(data_dir) / name
    fetched = _ensure_files(name, folder=folder, download=download, progress=progress)
    source = "downloaded" if fetched else "cache"
    if name == "mnist":
        train, test, shape, extra = _mnist(folder)
    elif name == "cifar10":
        train, test, shape, extra = _cifar10(folder / _CIFAR_DIR)
    else:
        train, test, shape, extra = _shakespeare(folder / "input.txt", seq_len=seq_len)
    meta = {"input_shape": shape, "num_classes": 10, "vocab_size": None, "source": source,
            "path": str(folder), **extra}
    return Splits(name=name, train=train, test=test, meta=meta)


def dataset_status(name: str, *, data_dir: Path) -> str:
    """"cached" | "downloadable" | "bundled" | "generated" | "unavailable: <why>", offline."""
    _check_name(name)
    if name == "synthetic":
        return "generated"
    if name == "digits":
        if importlib.util.find_spec("sklearn") is None:
            return "unavailable: scikit-learn is not installed (pip install 'fdl[bench]')"
        return "bundled"
    folder = Path(data_dir) / name
    return "cached" if all((folder / f).is_file() for f in _FILES[name]) else "downloadable"


def _check_name(name: str) -> None:
    if name not in NAMES:
        raise UsageError(f"unknown dataset {name!r}; choose one of: {', '.join(NAMES)}")


def _ensure_files(name: str, *, folder: Path, download: bool, progress: Progress | None) -> bool:
    """Make every file of ``name`` present and verified in ``folder`` (and CIFAR-10's batches
    extracted), under the folder's lock; True if any file was downloaded."""
    missing = [f for f in _FILES[name] if not (folder / f).is_file()]
    if missing and not download:
        raise FdlError(f"dataset {name} is not in the cache {folder} (missing: "
                       f"{', '.join(missing)}) and downloading is off",
                       hint=f"run once with downloading allowed, or copy {', '.join(missing)} "
                            f"into {folder} (they are checked against their published checksums)")
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    fetched = False
    with FileLock(folder / ".lock"):
        for file in _FILES[name]:
            path = folder / file
            if path.is_file():
                fetch.verify_cached(path, expected=CHECKSUMS[file])
                continue
            fetch.download(_urls(name, file), path, expected=CHECKSUMS[file],
                           progress=progress, on_retry=console.warn)
            fetched = True
        batches = folder / _CIFAR_DIR
        if name == "cifar10" and (fetched or not batches.is_dir()):
            _extract_cifar(folder / "cifar-10-binary.tar.gz", batches)
    return fetched


def _urls(name: str, file: str) -> list[str]:
    mirror = os.environ.get("FDL_DATA_MIRROR")
    if mirror:
        return [f"{mirror.rstrip('/')}/{file}"]
    return [base + file for base in BASE_URLS[name]]


def _read_idx(path: Path, *, magic: int) -> np.ndarray:
    """An IDX array of unsigned bytes: big-endian magic, one big-endian uint32 per dimension."""
    data = gzip.decompress(path.read_bytes())
    ndim = magic & 0xFF
    header = np.frombuffer(data[:4 + 4 * ndim], dtype=">u4")
    if len(header) != 1 + ndim or int(header[0]) != magic:
        raise FdlError(f"{path} is not an IDX file of {ndim}-d unsigned bytes "
                       f"(expected magic 0x{magic:08x})", hint="delete it and run again")
    dims = [int(d) for d in header[1:]]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise FdlError(f"{path} holds {body.size} bytes of data, its header promises "
                       f"{'x'.join(map(str, dims))}", hint="delete it and run again")
    return body.reshape(dims)


def _normalised(pixels: np.ndarray, mean, std) -> torch.Tensor:
    """uint8 [N,C,H,W] -> float32 ``(x/255 - mean) / std``, mean/std per channel."""
    x = torch.from_numpy(np.asarray(pixels, dtype=np.float32)).div_(255.0)
    mean_t = torch.tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)
    return x.sub_(mean_t).div_(std_t)


def _labels(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.int64))


def _mnist(folder: Path):
    def split(prefix: str) -> TensorDataset:
        images = _read_idx(folder / f"{prefix}-images-idx3-ubyte.gz", magic=_IDX_IMAGES)
        labels = _read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", magic=_IDX_LABELS)
        if len(images) != len(labels):
            raise FdlError(f"{prefix} split of mnist has {len(images)} images and "
                           f"{len(labels)} labels", hint=f"delete {folder} and run again")
        x = _normalised(images[:, None, :, :], MNIST_MEAN, MNIST_STD)
        return TensorDataset(x, _labels(labels))

    return split("train"), split("t10k"), (1, 28, 28), {}


def _cifar10(batches: Path):
    def split(files: tuple[str, ...]) -> TensorDataset:
        parts = [np.fromfile(batches / f, dtype=np.uint8) for f in files]
        if any(part.size % _CIFAR_RECORD for part in parts):
            raise FdlError(f"a CIFAR-10 batch in {batches} is not a whole number of "
                           f"{_CIFAR_RECORD}-byte records", hint=f"delete {batches} and run again")
        records = np.concatenate(parts).reshape(-1, _CIFAR_RECORD)
        pixels = records[:, 1:].reshape(-1, 3, 32, 32)  # R, G, B planes, row-major
        return TensorDataset(_normalised(pixels, CIFAR10_MEAN, CIFAR10_STD),
                             _labels(records[:, 0]))

    return split(_CIFAR_BATCHES[:5]), split(_CIFAR_BATCHES[5:]), (3, 32, 32), {}


def _extract_cifar(archive: Path, target: Path) -> None:
    """Write the six batch files to a staging folder beside ``target``, then rename it there.

    One streaming pass over the archive: any member with an absolute path or a ``..`` refuses
    the whole archive; only the six regular batch files are written (through ``extractfile``,
    never ``extract``, so no link or device is ever created). The staging folder is removed on
    any failure, so ``target`` is either complete or absent."""
    wanted = {f"{_CIFAR_DIR}/{file}": file for file in _CIFAR_BATCHES}
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
    try:
        with tarfile.open(archive, "r|gz") as tar:
            for member in tar:
                name = PurePosixPath(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise FdlError(f"{archive} holds an unsafe member {member.name!r}",
                                   hint="the archive is not the CIFAR-10 one; delete it")
                file = wanted.get(str(name))
                if file is not None and member.isreg():
                    with tar.extractfile(member) as source, open(staging / file, "wb") as out:
                        shutil.copyfileobj(source, out, _CHUNK)
        missing = [f for f in _CIFAR_BATCHES if not (staging / f).is_file()]
        if missing:
            raise FdlError(f"{archive} lacks {', '.join(missing)} under {_CIFAR_DIR}/",
                           hint="the archive is not the CIFAR-10 one; delete it")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise FdlError(f"cannot read {archive}: {exc}", hint="delete it and run again") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _shakespeare(path: Path, *, seq_len: int):
    text = path.read_bytes().decode("utf-8")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    vocab = np.unique(codes)  # sorted code points == sorted(set(text))
    ids = np.searchsorted(vocab, codes).astype(np.int64)
    cut = int(len(ids) * 0.9)

    def windows(part: np.ndarray, split: str) -> TensorDataset:
        count = (len(part) - 1) // seq_len
        if count < 1:
            raise UsageError(f"seq_len {seq_len} is too long for shakespeare's {split} split "
                             f"({len(part)} characters)")
        x = part[:count * seq_len].reshape(count, seq_len)
        y = part[1:count * seq_len + 1].reshape(count, seq_len)
        return TensorDataset(torch.from_numpy(x.copy()), torch.from_numpy(y.copy()))

    return (windows(ids[:cut], "train"), windows(ids[cut:], "test"), (seq_len,),
            {"num_classes": None, "vocab_size": len(vocab)})


def _digits() -> Splits:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise FdlError("the digits dataset needs scikit-learn, which is not installed",
                       hint="pip install 'fdl[bench]'") from exc
    images, labels = load_digits(return_X_y=True)
    x = (images.reshape(-1, 1, 8, 8) / 16.0).astype(np.float32)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(x))
    num_test = len(x) // 5
    train_idx, test_idx = order[num_test:], order[:num_test]
    mean, std = x[train_idx].mean(), x[train_idx].std()  # the test split must not leak in
    x = (x - mean) / std
    return _offline("digits", x, labels, train_idx, test_idx, source="bundled")


def _synthetic() -> Splits:
    """10 fixed 8x8 prototypes; each sample is its class's prototype plus unit Gaussian noise.

    Prototypes are scaled so that classes overlap a little: a linear model learns most of it,
    none reaches 100%, so accuracy still tells models and policies apart. 16384 training
    samples: an epoch long enough that ``fdl bench --quick`` measures the policies' steady state
    rather than their epoch-end averages."""
    num_train, num_test = 16384, 2048
    rng = np.random.default_rng(_SYNTHETIC_SEED)
    prototypes = rng.normal(scale=0.45, size=(10, 1, 8, 8))
    labels = rng.integers(0, 10, size=num_train + num_test)
    x = (prototypes[labels] + rng.normal(size=(len(labels), 1, 8, 8))).astype(np.float32)
    index = np.arange(len(labels))
    return _offline("synthetic", x, labels, index[:num_train], index[num_train:],
                    source="generated")


def _offline(name: str, x: np.ndarray, labels: np.ndarray, train_idx: np.ndarray,
             test_idx: np.ndarray, *, source: str) -> Splits:
    def split(idx: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(np.ascontiguousarray(x[idx], dtype=np.float32)),
                             _labels(labels[idx]))

    meta = {"input_shape": (1, 8, 8), "num_classes": 10, "vocab_size": None, "source": source,
            "path": None}
    return Splits(name=name, train=split(train_idx), test=split(test_idx), meta=meta)
