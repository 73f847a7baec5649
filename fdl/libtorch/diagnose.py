"""``fdl diagnose`` as data: the survey, the verdicts, one conclusion and the next command.

:func:`build_report` is pure (tests feed it surveys); :func:`collect_report` runs the probes
(host, GPUs, torch wheel) concurrently and builds it. ``DiagnoseReport.to_dict`` is the
``fdl diagnose --json`` document (``"schema": 1``, documented in docs/cli.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fdl.libtorch.catalog import LINUX_X86_64, WINDOWS_X86_64
from fdl.libtorch.coverage import BuildAdvice, BuildCoverage, advise_builds, check_build
from fdl.libtorch.environments import EnvironmentPlan, plan_environments
from fdl.libtorch.wheel import CPU_WHEEL as CPU_WHEEL_INSTALL
from fdl.libtorch.wheel import torch_install
from fdl.paths import flodl_home
from fdl.system.gpus import GpuSurvey
from fdl.system.host import HostInfo, NetInterface
from fdl.system.torchenv import TorchInfo
from fdl.version import __version__

SCHEMA = 1
CPU_WHEEL = str(CPU_WHEEL_INSTALL)  # findings carry the command as text


@dataclass(frozen=True)
class Finding:
    level: str  # ok | info | warn | error
    message: str
    command: str | None = None


@dataclass(frozen=True)
class DiagnoseReport:
    context: dict[str, Any]
    host: HostInfo
    survey: GpuSurvey
    torch: TorchInfo
    torch_coverage: BuildCoverage | None
    advice: BuildAdvice
    findings: tuple[Finding, ...]
    verdict: Finding
    libtorch: dict[str, Any] | None = None  # the active variant: id, path, version, cuda, archs
    libtorch_coverage: BuildCoverage | None = None
    # no single build covers every GPU: one environment per device class (fdl setup's proposal)
    environments: EnvironmentPlan | None = None

    @property
    def gpus_uncovered(self) -> bool:
        """True when some GPU cannot run the installed torch (what ``--strict`` fails on)."""
        if not self.survey.gpus:
            return False
        return self.torch_coverage is None or bool(self.torch_coverage.missing)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


def collect_report(*, env: Mapping[str, str] | None = None) -> DiagnoseReport:
    """Probe host, GPUs and the torch wheel (concurrently) and build the report."""
    from concurrent.futures import ThreadPoolExecutor

    from fdl.system.gpus import probe_gpus
    from fdl.system.host import probe_host
    from fdl.system.torchenv import probe_torch

    env = os.environ if env is None else env
    with ThreadPoolExecutor(max_workers=3) as pool:
        host = pool.submit(probe_host)
        survey = pool.submit(probe_gpus, env=env)
        torch = pool.submit(probe_torch)
        libtorch, problems = read_libtorch_store()
        return build_report(host=host.result(), survey=survey.result(), torch=torch.result(),
                            context=_context(env), libtorch=libtorch,
                            libtorch_problems=problems)


def read_libtorch_store() -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The active variant of the libtorch store as data (None when none is), and one line per
    problem with the store. Never raises: ``fdl diagnose`` must not fail because of the store
    (an unusable FLODL_HOME or a broken entry becomes a problem line)."""
    from fdl.errors import FdlError
    from fdl.libtorch.store import Store
    from fdl.paths import libtorch_root

    try:
        store = Store(libtorch_root())
        variant, problems = store.active(), tuple(store.problems())
    except (FdlError, OSError) as exc:
        return None, (getattr(exc, "message", None) or str(exc),)
    if variant is None:
        return None, problems
    meta = variant.meta
    return {"id": variant.id, "path": str(variant.path), "version": meta.get("version"),
            "cuda": meta.get("cuda"), "archs": _cuda_archs(meta.get("archs") or [])}, problems


def _cuda_archs(archs: list[str]) -> list[str]:
    """The CUDA entries of a variant's arch list (a ROCm build lists gfx targets)."""
    from fdl.errors import UsageError
    from fdl.system.compat import parse_arch_list

    kept = []
    for arch in archs:
        try:
            parse_arch_list([arch])
        except UsageError:
            continue
        kept.append(arch)
    return kept


def _context(env: Mapping[str, str]) -> dict[str, Any]:
    from fdl.paths import flodl_home

    return {
        "fdl_version": __version__,
        "flodl_home": str(flodl_home()),
        "gpu_survey_fixture": env.get("FDL_GPU_SURVEY"),
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "virtual_env": env.get("VIRTUAL_ENV"),
    }


def catalog_platform(host: HostInfo) -> str | None:
    machine = host.machine.lower()
    if machine not in ("x86_64", "amd64"):
        return None  # the catalog lists x86_64 builds only (aarch64 builds differ)
    return WINDOWS_X86_64 if host.os_name.lower().startswith("win") else LINUX_X86_64


def build_report(*, host: HostInfo, survey: GpuSurvey, torch: TorchInfo,
                 context: dict[str, Any], libtorch: dict[str, Any] | None = None,
                 libtorch_problems: tuple[str, ...] = ()) -> DiagnoseReport:
    platform = catalog_platform(host)
    windows = platform == WINDOWS_X86_64
    coverage = None
    if torch.installed and torch.version and not torch.error:
        coverage = check_build(survey, label=f"torch {torch.version}", archs=torch.arch_list,
                               cuda=torch.cuda_version, windows=windows)
    advice = advise_builds(survey, platform=platform) if platform else advise_builds(
        dataclasses.replace(survey, gpus=()))
    environments = plan_environments(survey, home=flodl_home(), fdl_requirement="fdl",
                                     platform=platform) if platform else None
    findings = [*_gpu_findings(survey, torch, coverage, advice, environments),
                *_host_findings(host, torch), *_peer_findings(torch)]
    libtorch_coverage = None
    if libtorch is not None:
        libtorch_coverage = check_build(survey, label=f"libtorch {libtorch['id']}",
                                        archs=libtorch["archs"], cuda=libtorch["cuda"],
                                        windows=windows)
        findings.append(_libtorch_finding(survey, libtorch_coverage))
    else:
        findings.append(Finding("info", "no libtorch variant is active (C++ builds)",
                                "fdl setup"))
    findings += [Finding("warn", f"libtorch store: {problem}", "fdl libtorch list")
                 for problem in libtorch_problems]
    verdict = _verdict(survey, torch, coverage, advice, findings, environments)
    return DiagnoseReport(context, host, survey, torch, coverage, advice, tuple(findings),
                          verdict, libtorch, libtorch_coverage, environments)


def _peer_findings(torch: TorchInfo) -> list[Finding]:
    """One finding per GPU pair without peer access: NCCL's P2P on it is what fdl run turns
    off (fdl.engine.p2p)."""
    return [Finding("warn", f"GPUs {i} and {j} have no peer-to-peer access: fdl run sets "
                            "NCCL_P2P_DISABLE=1 for NCCL runs on them (NCCL then goes "
                            "through host memory; NCCL_P2P_DISABLE=0 forces P2P on)")
            for i, j, ok in torch.peer_access if not ok]


def _libtorch_finding(survey: GpuSurvey, coverage: BuildCoverage) -> Finding:
    if not survey.gpus or coverage.covers_all:
        return Finding("ok", f"{coverage.label} is active"
                       + (" and covers every GPU" if survey.gpus else ""))
    missing = ", ".join(f"{g.name} ({g.arch})" for g in coverage.missing)
    return Finding("warn", f"{coverage.label} is active but does not cover {missing}",
                   "fdl setup")


def install_command(advice: BuildAdvice) -> str | None:
    """The exact command that installs a torch wheel covering every GPU, or a source build, as
    a person reads it (``fdl.libtorch.wheel.torch_install`` holds its argv)."""
    command = torch_install(advice)
    return None if command is None else str(command)


def _gpu_findings(survey: GpuSurvey, torch: TorchInfo, coverage: BuildCoverage | None,
                  advice: BuildAdvice, environments: EnvironmentPlan | None) -> list[Finding]:
    findings = [Finding("info", note) for note in survey.notes]
    if coverage:
        for item in coverage.gpus:
            if item.driver.status == "too-old":
                findings.append(Finding("error", f"GPU {item.gpu.index} {item.gpu.name}: "
                                        f"{item.driver.reason}",
                                        f"install NVIDIA driver >= {item.driver.needed}"))
            elif item.kernel.status == "ptx-jit":
                findings.append(Finding("warn", f"GPU {item.gpu.index} {item.gpu.name}: "
                                        f"{item.kernel.reason}"))
        if coverage.runtime and coverage.runtime.status in ("minor-compat", "too-old"):
            level = "warn" if coverage.runtime.runs else "error"
            findings.append(Finding(level, f"{coverage.label}: {coverage.runtime.reason}"))
    if survey.gpus and not advice.covering and advice.source_arch_list:
        names = " + ".join(f"{g.name} ({g.arch})" for g in survey.gpus)
        message = f"no official torch build covers {names}"
        if advice.best_partial:
            left = ", ".join(g.name for g in advice.best_partial.missing)
            message += f"; {advice.best_partial.label} covers the most but leaves out {left}"
        if advice.source_cuda:
            low, high = advice.source_cuda
            span = f"CUDA {low}" + (f"-{high}" if high and high != low else "+" if not high else "")
            message += (f"; build from source with TORCH_CUDA_ARCH_LIST="
                        f'"{advice.source_arch_list}" and {span}')
        findings.append(Finding("warn", message, install_command(advice)))
    if environments is not None:
        findings.append(Finding("info", f"without a source build: {environments.summary()}, "
                                "one worker per card (fdl run --worker-python)",
                                "fdl setup --dry-run"))
    if torch.cuda_version and not survey.gpus:
        findings.append(Finding(
            "warn", f"torch {torch.version} is a CUDA build but this host has no usable NVIDIA "
            "GPU: it runs on CPU, carries GBs of unused CUDA libraries, and scripts that pick "
            "bf16/autocast from torch.cuda.is_available() may choose settings for a GPU that "
            "will not train", CPU_WHEEL))
    return findings


def _families(interface: NetInterface) -> str:
    """``IPv4``, ``IPv6`` or ``IPv4+IPv6`` (a dual-stack interface), from its addresses that
    another machine could use (not link-local)."""
    import ipaddress

    usable = [a for a in interface.ipv4 + interface.ipv6
              if not ipaddress.ip_address(a).is_link_local]
    kinds = sorted({f"IPv{ipaddress.ip_address(a).version}" for a in usable})
    return "+".join(kinds)


def _host_findings(host: HostInfo, torch: TorchInfo) -> list[Finding]:
    findings = []
    routable = host.routable_interfaces
    if len(routable) > 1:
        names = ", ".join(f"{i.name} ({_families(i)})" for i in routable)
        mixed = len({_families(i) for i in routable}) > 1
        default = host.default_route_interface
        findings.append(Finding(
            "info", f"several network interfaces ({names}): in a multi-node run fdl run "
            "exports the one that routes to the rendezvous endpoint as GLOO_SOCKET_IFNAME and "
            "NCCL_SOCKET_IFNAME (yours win when set)"
            + (", and the job uses the endpoint's address family" if mixed else "")
            + (f"; the default route leaves by {default}" if default else ""),
            "fdl diagnose --peer NODE0:29400"))
    if torch.cuda_available:
        findings.append(Finding(
            "info", "torch sees CUDA: CPU workers (fdl run --nproc-per-node cpu, which hides "
            "the GPUs from them) must take their dtype and autocast from the training device, "
            "not torch.cuda.is_available() (fdl.Trainer and run.autocast() do); --backend cpu is how GPU "
            "workers average, through host memory"))
    nvcc = next((t for t in host.tools if t.name == "nvcc" and t.version), None)
    if nvcc and torch.cuda_version and nvcc.version.split(".")[0] != torch.cuda_version.split(".")[0]:
        findings.append(Finding(
            "info", f"nvcc {nvcc.version} and torch's CUDA {torch.cuda_version} differ in major "
            "version: C++/CUDA extensions built with this nvcc will not load into this torch"))
    return findings


def _verdict(survey: GpuSurvey, torch: TorchInfo, coverage: BuildCoverage | None,
             advice: BuildAdvice, findings: list[Finding],
             environments: EnvironmentPlan | None = None) -> Finding:
    verdict = _torch_verdict(survey, torch, coverage, advice, findings)
    if environments is None or verdict.command != install_command(advice) or torch.error:
        return verdict  # a driver to install first, or nothing a wheel would fix
    return Finding(verdict.level, f"{verdict.message}; fdl's option: {environments.summary()}",
                   "fdl setup --dry-run")


def _torch_verdict(survey: GpuSurvey, torch: TorchInfo, coverage: BuildCoverage | None,
                   advice: BuildAdvice, findings: list[Finding]) -> Finding:
    command = install_command(advice)
    if torch.error:
        return Finding("error", f"the torch wheel could not be probed: {torch.error}",
                       "python -c 'import torch'")
    if not survey.gpus:
        if not torch.installed:
            return Finding("warn", "no NVIDIA GPU; torch is not installed", CPU_WHEEL)
        return Finding("ok", f"no NVIDIA GPU; torch {torch.version} will train on the CPU")
    driver_errors = [f for f in findings if f.level == "error" and f.command]
    if driver_errors:
        return driver_errors[0]
    count = len(survey.gpus)
    if not torch.installed:
        return Finding("warn", f"torch is not installed ({count} GPU(s) found)", command)
    assert coverage is not None  # installed, no error -> checked
    if not coverage.cuda:
        return Finding("error", f"torch {torch.version} is a CPU-only build: "
                       f"none of the {count} GPU(s) will be used", command)
    if coverage.missing:
        names = ", ".join(f"{g.name} ({g.arch})" for g in coverage.missing)
        return Finding("error", f"torch {torch.version} has no kernels for {names}", command)
    if coverage.runtime and coverage.runtime.status == "too-old":
        return Finding("error", coverage.runtime.reason,
                       f"install NVIDIA driver >= {coverage.runtime.needed}")
    return Finding("ok", f"torch {torch.version} covers every GPU ({count})")


def _to_dict(report: DiagnoseReport) -> dict[str, Any]:
    survey, torch, advice = report.survey, report.torch, report.advice
    return {
        "schema": SCHEMA,
        "context": report.context,
        "system": dataclasses.asdict(report.host),
        "gpus": {
            "source": survey.source,
            "driver_version": survey.driver_version,
            "cuda_driver_version": survey.cuda_driver_version,
            "visible_devices": survey.visible_devices,
            "notes": list(survey.notes),
            "devices": [{**dataclasses.asdict(g), "compute_capability": g.cc, "arch": g.arch}
                        for g in survey.gpus],
        },
        "torch": {**dataclasses.asdict(torch), "coverage": _coverage_dict(report.torch_coverage)},
        "compatibility": {
            "covering_builds": [c.label for c in advice.covering],
            "recommended": advice.recommended.label if advice.recommended else None,
            "best_partial": None if not advice.best_partial else {
                "build": advice.best_partial.label,
                "left_out": [g.name for g in advice.best_partial.missing]},
            "source_build": None if not advice.source_arch_list else {
                "torch_cuda_arch_list": advice.source_arch_list,
                "cuda_min": advice.source_cuda[0] if advice.source_cuda else None,
                "cuda_max": advice.source_cuda[1] if advice.source_cuda else None},
            "driver_needed": advice.driver_needed,
            "install_command": install_command(advice),
            "environments": report.environments.to_dict() if report.environments else None,
        },
        "libtorch": None if report.libtorch is None else {
            **report.libtorch, "coverage": _coverage_dict(report.libtorch_coverage)},
        "findings": [dataclasses.asdict(f) for f in report.findings],
        "verdict": dataclasses.asdict(report.verdict),
    }


def _coverage_dict(coverage: BuildCoverage | None) -> dict[str, Any] | None:
    if coverage is None:
        return None
    return {
        "build": coverage.label,
        "covers_all": coverage.covers_all,
        "runtime_driver": None if coverage.runtime is None else dataclasses.asdict(coverage.runtime),
        "gpus": [{"index": item.gpu.index, "name": item.gpu.name, "arch": item.gpu.arch,
                  "status": item.kernel.status if item.driver.status != "too-old" else "driver-too-old",
                  "via": item.kernel.via, "reason": item.kernel.reason}
                 for item in coverage.gpus],
    }
