"""The per-node utilisation sampler (fdl/engine/sampler.py).

This machine has no GPU: NVML is faked at its boundary (a fake ``pynvml``-like object passed
as ``nvml=``), and torch's CUDA device properties, where needed, by monkeypatching
``torch.cuda.get_device_properties``. psutil and the file output are real.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fdl.engine.sampler import (
    Sampler,
    cuda_bus_id,
    map_cuda_to_nvml,
    normalise_bus_id,
    start_node_sampler,
)

GIB = 1 << 30


class FakeNvml:
    """The pynvml calls the sampler makes. ``gpus`` maps NVML's canonical bus id to
    ``(util %, used bytes, total bytes)``; handles are ``"nvml<physical index>"``. A bus id
    in ``broken`` is found but every read on it raises."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: dict[str, tuple[float, int, int]], *, broken: tuple[str, ...] = (),
                 init_error: bool = False):
        self.gpus = gpus
        self.broken = broken
        self.init_error = init_error
        self.num_inits = self.num_shutdowns = 0
        self.lookups: list[str] = []

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError("NVML Shared Library Not Found")
        self.num_inits += 1

    def nvmlShutdown(self):
        self.num_shutdowns += 1

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str):
        # Strict on purpose: only NVML's own form matches, so the caller must normalise.
        self.lookups.append(bus_id)
        if bus_id not in self.gpus:
            raise self.NVMLError("Not Found")
        return f"nvml{list(self.gpus).index(bus_id)}"

    def _stats(self, handle: str) -> tuple[float, int, int]:
        bus_id = list(self.gpus)[int(handle.removeprefix("nvml"))]
        if bus_id in self.broken:
            raise self.NVMLError("GPU is lost")
        return self.gpus[bus_id]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self._stats(handle)[0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        _, used, total = self._stats(handle)
        return SimpleNamespace(used=used, total=total, free=total - used)


# Two physical GPUs in PCI order (NVML index 0 at bus 0x3B, index 1 at bus 0xAF).
PHYSICAL = {"00000000:3B:00.0": (10.0, 1 * GIB, 80 * GIB),
            "00000000:AF:00.0": (90.0, 5 * GIB, 24 * GIB)}


def fake_cuda_buses(monkeypatch, buses: list[int]) -> None:
    """CUDA device i sits on PCI bus ``buses[i]`` (domain 0, device 0), as torch reports it."""
    def properties(index: int):
        if index >= len(buses):
            raise AssertionError(f"Invalid device id {index}")
        return SimpleNamespace(pci_domain_id=0, pci_bus_id=buses[index], pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize(("given", "canonical"), [
    ("0000:3b:00.0", "00000000:3B:00.0"),       # CUDA / sysfs form
    ("00000000:3B:00.0", "00000000:3B:00.0"),   # NVML's own form
    ("00000000:af:00.0", "00000000:AF:00.0"),   # case
    ("3B:00.0", "00000000:3B:00.0"),            # no domain
    ("0001:3b:1f", "00000001:3B:1F.0"),         # no function
    (" 0000:3b:00.0\n", "00000000:3B:00.0"),
])
def test_normalise_bus_id(given, canonical):
    assert normalise_bus_id(given) == canonical


@pytest.mark.parametrize("bad", ["", "GPU-1234", "0000:3b", "0000:3b:00.9", "zz:00.0"])
def test_normalise_bus_id_rejects_garbage(bad):
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalise_bus_id(bad)


def test_mapping_follows_bus_id_not_index():
    """CUDA_VISIBLE_DEVICES=1,0: CUDA 0 is the second physical GPU, CUDA 1 the first."""
    nvml = FakeNvml(PHYSICAL)
    assert map_cuda_to_nvml(["0000:af:00.0", "0000:3b:00.0"], nvml) == ["nvml1", "nvml0"]
    assert nvml.lookups == ["00000000:AF:00.0", "00000000:3B:00.0"]


def test_mapping_gives_none_for_unknown_missing_or_malformed_ids():
    nvml = FakeNvml(PHYSICAL)
    assert map_cuda_to_nvml(["0000:3b:00.0", "0000:02:00.0", None, "nonsense"], nvml) == [
        "nvml0", None, None, None]


def test_cuda_bus_id_formats_torch_integers(monkeypatch):
    fake_cuda_buses(monkeypatch, [0xAF])
    assert cuda_bus_id(0) == "0000:af:00.0"
    assert cuda_bus_id(1) is None  # no such device


def test_sample_reads_gpus_by_bus_id_and_nulls_a_broken_one(monkeypatch, tmp_path):
    fake_cuda_buses(monkeypatch, [0xAF, 0x3B, 0x05])  # CUDA 2 is unknown to NVML
    nvml = FakeNvml(PHYSICAL, broken=("00000000:3B:00.0",))
    with Sampler(tmp_path / "s.jsonl", node=0, cuda_indices=[0, 1, 2], interval_s=10,
                 nvml=nvml) as sampler:
        gpus = sampler.sample()["gpus"]
    null = {"util_percent": None, "mem_used_bytes": None, "mem_total_bytes": None}
    assert gpus == [
        {"cuda_index": 0, "util_percent": 90.0, "mem_used_bytes": 5 * GIB,
         "mem_total_bytes": 24 * GIB},
        {"cuda_index": 1, **null},
        {"cuda_index": 2, **null},
    ]
    assert sampler.num_errors == 0
    assert (nvml.num_inits, nvml.num_shutdowns) == (1, 1)


def test_run_writes_one_line_per_interval(monkeypatch, tmp_path):
    fake_cuda_buses(monkeypatch, [0x3B])
    path = tmp_path / "timeline" / "samples-node2.jsonl"
    sampler = Sampler(path, node=2, cuda_indices=[0], interval_s=0.05,
                      nvml=FakeNvml(PHYSICAL)).start()
    time.sleep(0.35)
    sampler.stop()
    lines = read_lines(path)
    assert len(lines) >= 4
    assert len(lines) == sampler.num_samples
    assert sampler.num_errors == 0
    times = [line["t"] for line in lines]
    assert times == sorted(times) and len(set(times)) == len(times)
    for line in lines:
        assert set(line) == {"t", "node", "host", "cpu_percent", "ram_used_bytes",
                             "ram_total_bytes", "gpus"}
        assert line["node"] == 2 and line["host"] == socket.gethostname()
        assert 0.0 <= line["cpu_percent"] <= 100.0
        assert 0 < line["ram_used_bytes"] <= line["ram_total_bytes"]
        assert line["gpus"] == [{"cuda_index": 0, "util_percent": 10.0,
                                 "mem_used_bytes": GIB, "mem_total_bytes": 80 * GIB}]


def test_stop_is_prompt_and_idempotent(tmp_path):
    nvml = FakeNvml(PHYSICAL)
    path = tmp_path / "s.jsonl"
    sampler = Sampler(path, node=0, cuda_indices=[], interval_s=30, nvml=nvml).start()
    began = time.perf_counter()
    sampler.stop()
    assert time.perf_counter() - began < 0.5  # woken by the event, not after a 30 s tick
    assert len(read_lines(path)) == 1  # the last sample, written by stop()
    sampler.stop()
    assert len(read_lines(path)) == 1
    assert nvml.num_inits == nvml.num_shutdowns == 0  # no CUDA devices: NVML never opened


def test_append_keeps_an_earlier_attempts_lines(tmp_path):
    path = tmp_path / "s.jsonl"
    for _ in range(2):  # a worker and its elastic restart
        Sampler(path, node=0, cuda_indices=[], interval_s=30, nvml=FakeNvml({})).start().stop()
    lines = read_lines(path)
    assert len(lines) == 2 and lines[0]["t"] <= lines[1]["t"]


def test_nvml_unavailable_still_records_cpu_and_ram(monkeypatch, tmp_path):
    fake_cuda_buses(monkeypatch, [0x3B])
    nvml = FakeNvml(PHYSICAL, init_error=True)
    path = tmp_path / "s.jsonl"
    with Sampler(path, node=0, cuda_indices=[0], interval_s=0.02, nvml=nvml):
        time.sleep(0.1)
    lines = read_lines(path)
    assert lines and all(line["gpus"] == [] for line in lines)
    assert all(line["ram_total_bytes"] > 0 and "cpu_percent" in line for line in lines)
    assert nvml.num_shutdowns == 0 and nvml.lookups == []


def test_errors_in_the_thread_are_counted_not_raised(tmp_path):
    calls = iter(range(1_000_000))

    def flaky_clock() -> float:
        if next(calls) % 2 == 0:
            raise OSError("clock hiccup")
        return time.time()

    path = tmp_path / "s.jsonl"
    sampler = Sampler(path, node=0, cuda_indices=[], interval_s=0.01, nvml=FakeNvml({}),
                      clock=flaky_clock).start()
    time.sleep(0.15)
    sampler.stop()
    assert sampler.num_errors >= 2
    assert sampler.num_samples >= 2 and len(read_lines(path)) == sampler.num_samples


def test_start_node_sampler_only_on_local_rank_zero_with_a_run_dir(tmp_path):
    cpu = torch.device("cpu")
    assert start_node_sampler(tmp_path, local_rank=1, node=0, device=cpu,
                              local_world_size=2) is None
    assert start_node_sampler(None, local_rank=0, node=0, device=cpu,
                              local_world_size=2) is None
    assert not (tmp_path / "timeline").exists()

    sampler = start_node_sampler(tmp_path, local_rank=0, node=3, device=cpu, local_world_size=2)
    assert sampler is not None and sampler.cuda_indices == []
    sampler.stop()
    (line,) = read_lines(tmp_path / "timeline" / "samples-node3.jsonl")
    assert line["node"] == 3 and line["gpus"] == []


def test_start_node_sampler_reports_the_devices_local_ranks_use(monkeypatch, tmp_path):
    """3 local ranks on 2 visible GPUs share them as the trainer does: rank r on r % 2."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fake_cuda_buses(monkeypatch, [0x3B, 0xAF])
    sampler = start_node_sampler(tmp_path, local_rank=0, node=0,
                                 device=torch.device("cuda", 0), local_world_size=3)
    assert sampler is not None
    sampler.stop()
    assert sampler.cuda_indices == [0, 1]
