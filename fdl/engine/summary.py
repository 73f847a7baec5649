"""What a run leaves in its directory: ``summary.json`` (a contract for tools and benchmarks,
see ARCHITECTURE §4.6), ``metrics.jsonl`` (one line per epoch), ``model.pt`` (the consensus
state_dict) and the engine section of ``config.json``. Rank 0 writes them, atomically
(``metrics.jsonl`` is appended a line at a time with fdl.files.append_jsonl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fdl.files import append_jsonl as append_jsonl  # re-exported: the trainer appends metrics
from fdl.files import atomic_replace, write_atomic
from fdl.files import write_json_atomic as write_json_atomic  # re-exported: the trainer's summary


def build_summary(*, config: Any, world_size: int, devices: list[str], wall_s: float,
                  samples: list[int], busy_s: list[float], comm_ms: list[float], syncs: int,
                  eval_metrics: dict[str, float], final_loss: float | None,
                  extra: dict[str, Any]) -> dict[str, Any]:
    """``samples[r]`` and ``busy_s[r]``: rank r's samples and busy time over the run."""
    busy = busy_s
    compute_s = max(busy) if busy else 0.0
    return {
        "policy": str(config.policy),
        "backend": config.backend,
        "world_size": world_size,
        "devices": devices,
        "emulated_slowdown": list(config.simulate_slowdown) if config.simulate_slowdown else None,
        "epochs": config.epochs,
        "samples": sum(samples),
        "wall_s": wall_s,
        "throughput": {
            "samples_per_s": sum(samples) / wall_s if wall_s > 0 else None,
            "per_rank_samples_per_s": [s / wall_s if wall_s > 0 else None for s in samples],
        },
        "sync": {
            "rounds": syncs,
            "mean_ms": sum(comm_ms) / len(comm_ms) if comm_ms else None,
            "overhead": (sum(comm_ms) / 1000) / compute_s if comm_ms and compute_s > 0 else None,
        },
        "idle_fraction": [max(0.0, 1 - b / wall_s) if wall_s > 0 else None for b in busy],
        "eval": eval_metrics,
        "final_loss": final_loss,
        **extra,
    }


def rewrite_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` atomically (a resumed run drops the epochs it redoes)."""
    write_atomic(path, "".join(json.dumps(r, default=str) + "\n" for r in records))


def save_model(path: Path, model: nn.Module) -> None:
    """Write the model's ``state_dict`` (on the CPU) to ``path`` atomically."""
    with atomic_replace(path) as tmp:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)


def merge_config(path: Path, engine: dict[str, Any]) -> None:
    """Add the engine's resolved settings (with sources) to the launcher's config.json."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, not UTF-8 or not JSON: the engine's part only
        document = {}
    if not isinstance(document, dict):
        document = {}
    document["engine"] = engine
    write_json_atomic(path, document)
