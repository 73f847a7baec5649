"""The per-node utilisation sampler (fdl/engine/utilisation.py).

This machine has no GPU: NVML is faked at its boundary (a fake ``pynvml``-like object passed
as ``nvml=``), and torch's CUDA device properties, where needed, by monkeypatching
``torch.cuda.get_device_properties``. psutil, the thread and the file output are real; the
thread's wait between samples is a ``ManualTicks`` the test advances, so no test sleeps or
reads a clock to know how many samples there are.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fdl.engine.utilisation import (
    UtilisationSampler,
    cuda_bus_id,
    map_cuda_to_nvml,
    normalise_bus_id,
    start_utilisation_sampler,
)

GIB = 1 << 30
GUARD_S = 60  # only a guard against a hung test: every wait below ends on an event


class ManualTicks:
    """The sampler's stop event, driven by the test: the thread's ``wait`` returns False (take
    a sample) once per tick the test gives, True (stop) once ``set()`` is called, and never
    because time passed. ``timeouts`` records the interval of each wait."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending = 0
        self._waiting = self._stopped = False
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:  # the sampler thread's side
        with self._cond:
            self.timeouts.append(timeout)
            self._waiting = True
            self._cond.notify_all()
            woken = self._cond.wait_for(lambda: self._pending or self._stopped, GUARD_S)
            self._waiting = False
            if self._stopped or not woken:  # not woken: the test gave up, let the thread end
                return True
            self._pending -= 1
            return False

    def set(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def tick(self, count: int = 1) -> None:
        """Let the thread take ``count`` samples; returns once it waits again after the last."""
        with self._cond:
            self._pending += count
            self._cond.notify_all()
        self.wait_for_thread()

    def wait_for_thread(self) -> None:
        """Return once the thread waits with no tick left to take."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._waiting and not self._pending, GUARD_S)
        assert done, "the sampler thread did not come back to its wait"


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
    with UtilisationSampler(tmp_path / "s.jsonl", node=0, cuda_indices=[0, 1, 2], interval_s=10,
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


def test_no_sample_before_the_first_interval(tmp_path):
    ticks = ManualTicks()
    path = tmp_path / "s.jsonl"
    sampler = UtilisationSampler(path, node=0, cuda_indices=[], nvml=FakeNvml({}), stop_event=ticks).start()
    ticks.wait_for_thread()
    assert path.read_text(encoding="utf-8") == "" and sampler.num_samples == 0
    sampler.stop()


def test_each_interval_appends_one_sample_and_stop_a_last_one(monkeypatch, tmp_path):
    fake_cuda_buses(monkeypatch, [0x3B])
    ticks, times = ManualTicks(), itertools.count(1000)
    path = tmp_path / "timeline" / "samples-node2.jsonl"
    sampler = UtilisationSampler(path, node=2, cuda_indices=[0], interval_s=0.05, nvml=FakeNvml(PHYSICAL),
                      clock=lambda: float(next(times)), stop_event=ticks).start()
    ticks.tick(3)
    assert len(read_lines(path)) == sampler.num_samples == 3  # on disk as soon as taken
    sampler.stop()
    lines = read_lines(path)
    assert [line["t"] for line in lines] == [1000.0, 1001.0, 1002.0, 1003.0]
    assert sampler.num_samples == 4 and sampler.num_errors == 0
    assert set(ticks.timeouts) == {0.05}  # every wait is one interval
    for line in lines:
        assert set(line) == {"t", "node", "host", "cpu_percent", "ram_used_bytes",
                             "ram_total_bytes", "gpus"}
        assert line["node"] == 2 and line["host"] == socket.gethostname()
        assert 0.0 <= line["cpu_percent"] <= 100.0
        assert 0 < line["ram_used_bytes"] <= line["ram_total_bytes"]
        assert line["gpus"] == [{"cuda_index": 0, "util_percent": 10.0,
                                 "mem_used_bytes": GIB, "mem_total_bytes": 80 * GIB}]


def test_stop_wakes_the_thread_instead_of_waiting_out_the_interval(tmp_path):
    nvml = FakeNvml(PHYSICAL)
    path = tmp_path / "s.jsonl"
    sampler = UtilisationSampler(path, node=0, cuda_indices=[], interval_s=3600, nvml=nvml).start()
    stopped = threading.Event()
    threading.Thread(target=lambda: (sampler.stop(), stopped.set()), daemon=True).start()
    # stop() joins for up to interval_s + 2 s: only a woken thread lets it return in time
    assert stopped.wait(GUARD_S), "stop() waited for the hour-long interval"
    assert len(read_lines(path)) == 1  # the last sample, written by stop()
    sampler.stop()
    assert len(read_lines(path)) == 1
    assert nvml.num_inits == nvml.num_shutdowns == 0  # no CUDA devices: NVML never opened


def test_append_keeps_an_earlier_attempts_lines(tmp_path):
    path = tmp_path / "s.jsonl"
    for _ in range(2):  # a worker and its elastic restart
        UtilisationSampler(path, node=0, cuda_indices=[], interval_s=30, nvml=FakeNvml({})).start().stop()
    lines = read_lines(path)
    assert len(lines) == 2 and lines[0]["t"] <= lines[1]["t"]


def test_nvml_unavailable_still_records_cpu_and_ram(monkeypatch, tmp_path):
    fake_cuda_buses(monkeypatch, [0x3B])
    nvml, ticks = FakeNvml(PHYSICAL, init_error=True), ManualTicks()
    path = tmp_path / "s.jsonl"
    with UtilisationSampler(path, node=0, cuda_indices=[0], nvml=nvml, stop_event=ticks):
        ticks.tick(2)
    lines = read_lines(path)
    assert len(lines) == 3 and all(line["gpus"] == [] for line in lines)
    assert all(line["ram_total_bytes"] > 0 and "cpu_percent" in line for line in lines)
    assert nvml.num_shutdowns == 0 and nvml.lookups == []


def test_errors_in_the_thread_are_counted_not_raised(tmp_path):
    calls = itertools.count()

    def flaky_clock() -> float:  # fails on every other call: 0, 2, 4, ...
        if next(calls) % 2 == 0:
            raise OSError("clock hiccup")
        return time.time()

    ticks = ManualTicks()
    path = tmp_path / "s.jsonl"
    sampler = UtilisationSampler(path, node=0, cuda_indices=[], nvml=FakeNvml({}), clock=flaky_clock,
                      stop_event=ticks).start()
    ticks.tick(4)
    assert (sampler.num_samples, sampler.num_errors) == (2, 2)
    sampler.stop()  # its last sample is call 4: an error too, and stop() does not raise it
    assert (sampler.num_samples, sampler.num_errors) == (2, 3)
    assert len(read_lines(path)) == 2


def test_start_utilisation_sampler_only_on_local_rank_zero_with_a_run_dir(tmp_path):
    cpu = torch.device("cpu")
    assert start_utilisation_sampler(tmp_path, local_rank=1, node=0, device=cpu,
                              local_world_size=2) is None
    assert start_utilisation_sampler(None, local_rank=0, node=0, device=cpu,
                              local_world_size=2) is None
    assert not (tmp_path / "timeline").exists()

    sampler = start_utilisation_sampler(tmp_path, local_rank=0, node=3, device=cpu, local_world_size=2)
    assert sampler is not None and sampler.cuda_indices == []
    sampler.stop()
    (line,) = read_lines(tmp_path / "timeline" / "samples-node3.jsonl")
    assert line["node"] == 3 and line["gpus"] == []


def test_start_utilisation_sampler_reports_the_devices_local_ranks_use(monkeypatch, tmp_path):
    """3 local ranks on 2 visible GPUs share them as the trainer does: rank r on r % 2."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fake_cuda_buses(monkeypatch, [0x3B, 0xAF])
    sampler = start_utilisation_sampler(tmp_path, local_rank=0, node=0,
                                 device=torch.device("cuda", 0), local_world_size=3)
    assert sampler is not None
    sampler.stop()
    assert sampler.cuda_indices == [0, 1]
