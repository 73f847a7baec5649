"""Agreement before training: every rank checks that it runs what the others run.

Each node resolves its own flags, ``FDL_*`` variables and ``fdl.toml``, imports its own fdl
and torch, runs its own copy of the script and reads its own files. Left uncompared, two nodes
with different files of the same length train on a silent mixture; different lengths give
different plans and a hang later; a different epoch count or batch size, a hang at the end. So
twice, each rank publishes what it has and compares it with rank 0's (one
``all_gather_object`` each time, before anything trains):

* at ``fdl.init()``, right after the group forms: the fdl version, the torch release (its
  build tag may differ: a CUDA wheel beside a CPU one is the point of the ``cpu`` backend), the
  Python version, the script's sha256 and the engine settings that every rank must share;
* at ``run.batches(...)``, before rank 0's weights are broadcast: the number of training
  samples, a fingerprint of a few items of the data (positions drawn from the run's seed, read
  with every random generator seeded alike, so a random augmentation reads the same), and the
  model's parameter and buffer names, shapes and dtypes.

A difference stops every rank at once with the same one line: the field, the rank and node
that differ from rank 0, and both values (:class:`DisagreementError`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import random
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fdl.engine.config import plain
from fdl.engine.peers import ATTEMPT, NODES, PEERS, node_index, node_label, own_attempt
from fdl.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from fdl.engine.config import EngineConfig
    from fdl.engine.data import TrainData

#: the engine settings every rank must share (tensorboard, run_dir: where each node writes)
SHARED_SETTINGS = ("policy", "backend", "epochs", "batch_size", "seed", "simulate_slowdown",
                   "checkpoint_every", "precision", "micro_batch_size", "max_steps",
                   "max_samples", "max_time", "divergence_threshold", "overhead_target",
                   "max_grad_norm", "average_dtype", "outer_optimizer", "outer_lr",
                   "outer_momentum")
SAMPLED_ITEMS = 4  # items of the data read for its fingerprint
DIGEST = 16  # hex characters kept of a sha256


class DisagreementError(UsageError):
    """Ranks of one run do not run the same thing (fdl, torch, script, settings, data, model)."""


def runtime_facts(config: EngineConfig) -> dict[str, str]:
    """What must be alike before anything is built: software, script, settings."""
    from fdl.version import __version__

    main = getattr(sys.modules.get("__main__"), "__file__", None)
    settings = {name: plain(getattr(config, name)) for name in SHARED_SETTINGS}
    return {"fdl version": __version__,
            "torch release": torch.__version__.split("+")[0],
            "python": ".".join(platform.python_version_tuple()[:2]),
            "script sha256": _file_digest(main) if main else "none",
            "settings": json.dumps(settings, sort_keys=True)}


def data_facts(data: TrainData | None, model: nn.Module, *, seed: int) -> dict[str, str]:
    """What must be alike before training: the data and the model."""
    facts = {"model": _model_digest(model)}
    if data is None:  # a stream: no len(), no positions to compare
        return facts
    size = len(data)
    facts["train samples"] = str(size)
    facts["data fingerprint"] = _data_digest(data, seed=seed) if size else "empty"
    return facts


def agree(facts: Mapping[str, str], *, world_size: int, group: Any = None) -> None:
    """Compare this rank's ``facts`` with every rank's; raise the same
    :class:`DisagreementError` on every rank at the first difference."""
    if world_size <= 1:
        return
    mine = (node_label(), node_index(), own_attempt(), dict(facts))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    PEERS[:] = [label for label, _, _, _ in gathered]
    NODES[:] = [node for _, node, _, _ in gathered]
    ATTEMPT[:] = [max(attempt for _, _, attempt, _ in gathered)]
    problem = first_difference([(label, facts) for label, _, _, facts in gathered])
    if problem is not None:
        raise DisagreementError(problem, hint="run the same fdl, torch, script, settings and "
                                              "data on every node (fdl run --dry-run on each "
                                              "shows the settings and their sources)")


def first_difference(gathered: list[tuple[str, dict[str, str]]]) -> str | None:
    """The first field in which a rank differs from rank 0, in one line (None: all agree)."""
    label0, facts0 = gathered[0]
    for rank, (label, facts) in enumerate(gathered[1:], start=1):
        for field in facts0:
            if facts.get(field) != facts0[field]:
                ours, theirs = facts.get(field, "missing"), facts0[field]
                return (f"rank {rank} ({label}) and rank 0 ({label0}) differ in {field}: "
                        f"{_short(ours)} against {_short(theirs)}")
        extra = set(facts) - set(facts0)
        if extra:
            field = sorted(extra)[0]
            return (f"rank {rank} ({label}) and rank 0 ({label0}) differ in {field}: "
                    f"{_short(facts[field])} against missing")
    return None


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as handle:  # a script: small, read once
            return hashlib.sha256(handle.read()).hexdigest()[:DIGEST]
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"


def _model_digest(model: nn.Module) -> str:
    """Names, shapes and dtypes of the parameters and buffers (the values come from rank 0)."""
    shapes = [(name, tuple(t.shape), str(t.dtype))
              for name, t in (*model.named_parameters(), *model.named_buffers())]
    text = json.dumps(shapes)
    return f"{len(shapes)} tensors, {hashlib.sha256(text.encode()).hexdigest()[:DIGEST]}"


def _data_digest(data: TrainData, *, seed: int) -> str:
    from fdl.engine.data import collate

    size = len(data)
    positions = torch.randint(size, (min(SAMPLED_ITEMS, size),),
                              generator=torch.Generator().manual_seed(seed)).tolist()
    with _seeded_generators(seed):
        batch = collate(data, positions)
    digest = hashlib.sha256()
    _feed(batch, digest)
    return digest.hexdigest()[:DIGEST]


def _feed(value: Any, digest: Any) -> None:
    """Every tensor of a (nested) batch by its bytes, every other leaf by its repr."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
        if flat.numel():
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(value[key], digest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(item, digest)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _feed(getattr(value, field.name), digest)
    else:
        digest.update(repr(value).encode())


@contextmanager
def _seeded_generators(seed: int) -> Iterator[None]:
    """Python's, numpy's (when imported) and torch's CPU generators seeded alike on every rank,
    and given back as they were."""
    numpy = sys.modules.get("numpy")
    states = (random.getstate(), numpy.random.get_state() if numpy else None,
              torch.random.get_rng_state())
    random.seed(seed)
    if numpy:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        if numpy:
            numpy.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
