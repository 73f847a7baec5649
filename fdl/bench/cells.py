"""The units of a benchmark sweep: a :class:`Mode` (how a cell trains) and a :class:`Cell` (one
model on one dataset in one mode with one seed), shared by the planner
(:mod:`fdl.bench.sweep`) and the records (:mod:`fdl.bench.results`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """How a cell trains: ``policy`` is "solo" or an El Che policy; ``backend`` None for solo;
    ``slowdown`` the emulated factor per rank (None on real GPUs); ``devices`` GPU indices;
    ``threads`` each worker's CPU threads when emulating (None: the launcher decides)."""

    name: str
    policy: str
    backend: str | None
    world_size: int
    slowdown: tuple[float, ...] | None
    devices: tuple[int, ...] | None = None
    threads: int | None = None


@dataclass(frozen=True)
class Cell:
    model: str
    dataset: str
    mode: str
    policy: str
    backend: str | None
    seed: int
    world_size: int
    slowdown: tuple[float, ...] | None
    epochs: int
    devices: tuple[int, ...] | None = None
    threads: int | None = None

    @property
    def key(self) -> str:
        """Unique within a sweep and safe as a file name; names the run directory, so a record's
        ``run_dir`` gives its key back (resume reads it from there)."""
        factors = "_".join(format_factor(f) for f in self.slowdown) if self.slowdown else "real"
        return f"{self.model}.{self.dataset}.{self.mode}.x{factors}.seed{self.seed}.ep{self.epochs}"

    @property
    def emulated(self) -> bool:
        return self.slowdown is not None and any(f != 1.0 for f in self.slowdown)


def format_factor(value: float) -> str:
    return f"{value:g}"
