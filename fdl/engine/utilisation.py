"""Per-node utilisation samples (fdl.rundir.timeline.UtilisationSample), one JSON object a line, in
the run's timeline directory (``samples-node<node>.jsonl``).

On each node the worker with ``local_rank == 0`` runs one background thread that, every
``interval_s`` (100 ms by default), appends::

    {"t": 1718000000.123456, "node": 0, "host": "gpu-box", "cpu_percent": 37.5,
     "ram_used_bytes": 8123456512, "ram_total_bytes": 67345678336,
     "gpus": [{"cuda_index": 0, "util_percent": 98.0,
               "mem_used_bytes": 20971520000, "mem_total_bytes": 85899345920}]}

* ``cpu_percent`` is system-wide (``psutil.cpu_percent(interval=None)``: busy share since the
  previous sample), RAM is ``psutil.virtual_memory()``'s ``total - available``.
* ``gpus`` lists the CUDA devices this node's workers use. A CUDA index is matched to its NVML
  device by PCI bus id, never assumed equal to the NVML index: ``CUDA_VISIBLE_DEVICES`` and
  ``CUDA_DEVICE_ORDER`` (CUDA's default order is fastest-first, NVML's is PCI order) make them
  differ. A device NVML cannot find or read keeps its entry with ``null`` values.
* Without NVML (no driver, no ``pynvml``, init fails) or without CUDA devices, ``gpus`` is
  ``[]`` and CPU/RAM are still recorded.

The sampler never takes training down: an exception inside its thread is counted
(``UtilisationSampler.num_errors``) and the next tick tries again. The file is opened
line-buffered in append mode, so an elastically restarted worker continues the same file.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch

from fdl.files import JsonlAppender
from fdl.rundir.timeline import GpuReading, UtilisationSample, samples_path

_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})"
    r"(?:\.(?P<function>[0-7]))?$",
    re.IGNORECASE,
)
_JOIN_GRACE_S = 2.0


def normalise_bus_id(bus_id: str) -> str:
    """``bus_id`` in NVML's canonical form ``"00000000:01:00.0"`` (8-digit domain, upper case).

    Accepts CUDA's ``"0000:01:00.0"``, NVML's own form, a missing domain (``"01:00.0"``) or
    function (``"0000:01:00"``), in either case. Raises ValueError for anything else.
    """
    match = _BUS_ID.match(bus_id.strip())
    if match is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected domain:bus:device.function)")
    domain = int(match["domain"] or "0", 16)
    bus, device = int(match["bus"], 16), int(match["device"], 16)
    function = int(match["function"] or "0", 16)
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def map_cuda_to_nvml(bus_ids: Sequence[str | None], nvml: Any) -> list[Any | None]:
    """The NVML handle of each CUDA device, given the devices' PCI bus ids in CUDA order.

    ``nvml`` is the ``pynvml`` module (or a stand-in with ``nvmlDeviceGetHandleByPciBusId``).
    An id that is missing, malformed or unknown to NVML maps to ``None``.
    """
    handles: list[Any | None] = []
    for bus_id in bus_ids:
        try:
            canonical = normalise_bus_id(bus_id) if bus_id else None
            handles.append(nvml.nvmlDeviceGetHandleByPciBusId(canonical) if canonical else None)
        except Exception:  # ValueError, NVMLError_NotFound, or older bindings: no handle
            handles.append(None)
    return handles


def cuda_bus_id(index: int) -> str | None:
    """PCI bus id of CUDA device ``index`` as ``"0000:01:00.0"``; None if torch can't tell.

    torch exposes the id as three integers of ``cudaDeviceProp`` (``pci_domain_id``,
    ``pci_bus_id``, ``pci_device_id``), not as a string. CUDA does not report the PCI function;
    a GPU is function 0.
    """
    try:
        props = torch.cuda.get_device_properties(index)
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, AssertionError):  # older torch, or no such device
        return None


def _load_nvml(nvml: Any) -> Any | None:
    """``nvml`` (or the ``pynvml`` module) after a successful ``nvmlInit()``, else None."""
    if nvml is None:
        try:
            import pynvml as nvml  # lazily, in the sampler thread's owner only
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: sample without GPUs
        return None
    return nvml


def _read_gpu(nvml: Any, cuda_index: int, handle: Any | None) -> GpuReading:
    reading = GpuReading(cuda_index)
    if handle is None:
        return reading
    # NVMLError_NotSupported (MIG), GpuIsLost, ...: the value stays null, the sample goes on.
    with contextlib.suppress(Exception):
        reading = replace(reading,
                          util_percent=float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
    with contextlib.suppress(Exception):
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        reading = replace(reading, mem_used_bytes=int(memory.used),
                          mem_total_bytes=int(memory.total))
    return reading


class UtilisationSampler:
    """Appends one utilisation sample to ``path`` every ``interval_s`` from a daemon thread.

    ``nvml=None`` imports ``pynvml`` in ``start()``; pass a module-like object to replace it.
    ``cuda_indices`` are the CUDA devices to report (their NVML handles are looked up once, in
    ``start()``). ``clock`` gives each sample's ``t``. ``stop_event`` is what the thread waits
    on between samples and ``stop()`` sets: ``wait(interval_s)`` returning False means "take the
    next sample", True means "stop". It defaults to a fresh ``threading.Event``; a test passes
    one whose ``wait`` returns when the test says, so it drives the thread tick by tick.
    """

    def __init__(self, path: Path, *, node: int, cuda_indices: Sequence[int],
                 interval_s: float = 0.1, nvml: Any = None,
                 clock: Callable[[], float] = time.time,
                 stop_event: threading.Event | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.path = Path(path)
        self.node = node
        self.cuda_indices = list(cuda_indices)
        self.interval_s = interval_s
        self.num_samples = 0
        self.num_errors = 0
        self._nvml_arg = nvml
        self._clock = clock
        self._nvml: Any | None = None
        self._gpus: list[tuple[int, Any | None]] = []
        self._host = ""
        self._file: JsonlAppender | None = None
        self._thread: threading.Thread | None = None
        self._stop_event = stop_event if stop_event is not None else threading.Event()
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> UtilisationSampler:
        """Open the file, find the GPUs and start the thread (first sample after one interval)."""
        with self._lock:
            if self._thread is not None or self._stopped:
                raise RuntimeError("a UtilisationSampler can be started only once")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Appended a line at a time: a killed worker's samples survive, a restarted one
            # continues the file (on a fresh line after a torn one).
            self._file = JsonlAppender(self.path)
            self._host = socket.gethostname()
            self._nvml = _load_nvml(self._nvml_arg) if self.cuda_indices else None
            if self._nvml is not None:
                bus_ids = [cuda_bus_id(index) for index in self.cuda_indices]
                handles = map_cuda_to_nvml(bus_ids, self._nvml)
                self._gpus = list(zip(self.cuda_indices, handles, strict=True))
            # The first call only sets the baseline, so the first sample is one interval later:
            # a sample now would report the CPU share of the last few microseconds.
            psutil.cpu_percent(interval=None)
            self._thread = threading.Thread(target=self._run, name=f"fdl-sampler-node{self.node}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, write a last sample, close the file and NVML. Safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stop_event.set()
            if self._thread is None:
                return
            self._thread.join(timeout=self.interval_s + _JOIN_GRACE_S)
            if not self._thread.is_alive():  # one stuck in a driver call could still write
                self._sample_safely()
            assert self._file is not None
            self._file.close()
            self._file = None
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    self.num_errors += 1

    def __enter__(self) -> UtilisationSampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def sample(self) -> dict[str, Any]:
        """One sample record (does not write it)."""
        memory = psutil.virtual_memory()
        return UtilisationSample(
            t=round(self._clock(), 6), node=self.node, host=self._host,
            cpu_percent=float(psutil.cpu_percent(interval=None)),
            ram_used_bytes=int(memory.total - memory.available),
            ram_total_bytes=int(memory.total),
            gpus=[_read_gpu(self._nvml, index, handle) for index, handle in self._gpus],
        ).to_dict()

    def _run(self) -> None:
        # Event.wait, not sleep: stop() wakes the thread at once instead of after a tick.
        while not self._stop_event.wait(self.interval_s):
            self._sample_safely()

    def _sample_safely(self) -> None:
        try:
            record = self.sample()
            if self._file is not None:
                self._file.append(record)
                self.num_samples += 1
        except Exception:  # disk full, psutil hiccup, ...: never let sampling stop training
            self.num_errors += 1


def start_utilisation_sampler(run_dir: Path | None, *, local_rank: int, node: int,
                       device: torch.device, local_world_size: int,
                       interval_s: float = 0.1) -> UtilisationSampler | None:
    """Start this node's sampler from its ``local_rank == 0`` worker; None on other ranks or
    without a run directory.

    The GPUs reported are those the node's workers use: local rank ``r`` trains on CUDA device
    ``r % device_count`` (as the trainer picks it) when ``device`` is a CUDA device.
    """
    if run_dir is None or local_rank != 0:
        return None
    cuda_indices: list[int] = []
    if device.type == "cuda":
        num_devices = torch.cuda.device_count()
        if num_devices > 0:
            cuda_indices = sorted({rank % num_devices for rank in range(local_world_size)})
    path = samples_path(Path(run_dir), node)
    return UtilisationSampler(path, node=node, cuda_indices=cuda_indices, interval_s=interval_s).start()
