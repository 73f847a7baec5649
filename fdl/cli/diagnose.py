"""``fdl diagnose``: what this host has, and whether the installed torch runs on every GPU.

    fdl diagnose            # the report: Context, System, GPUs, Python torch, Compatibility
    fdl diagnose --json     # one JSON document ("schema": 1, see docs/cli.md)
    fdl diagnose --strict   # exit 1 when a GPU is not covered by the installed torch build
    fdl diagnose --peer node0:29400   # can this node reach a rendezvous endpoint? (exit 1: no)

The GPU survey honours ``CUDA_VISIBLE_DEVICES`` and the test seam ``FDL_GPU_SURVEY=<file.json>``.
torch is probed in a subprocess; it is never imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from fdl.libtorch.diagnose import DiagnoseReport

_MARK = {"ok": ("ok", "green"), "info": ("note", "blue"), "warn": ("warn", "yellow"),
         "error": ("fail", "red")}


def diagnose(
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Exit 1 when any GPU is not covered by the installed torch.")] = False,
    peer: Annotated[str | None, typer.Option(
        "--peer", metavar="HOST[:PORT]",
        help="Only check that this node reaches a rendezvous endpoint (port 29400 by default) "
             "and say what blocks it; exit 1 when it does not.")] = None,
) -> None:
    """Survey GPUs, driver, CPU, tools and the torch wheel; say what to fix."""
    from fdl import console
    from fdl.libtorch.diagnose import collect_report

    if peer is not None:
        _peer(peer, json_output=json_output)
        return

    with console.status("surveying host, GPUs and torch..."):
        report = collect_report()
    if json_output:
        console.print_json(report.to_dict())
    else:
        _render(report)
    if strict and report.gpus_uncovered:
        raise typer.Exit(1)


def _peer(endpoint: str, *, json_output: bool) -> None:
    """``--peer``: the check of :mod:`fdl.launch.peer_check`, shown or as JSON."""
    from fdl import console
    from fdl.launch.peer_check import check_peer
    from fdl.libtorch.diagnose import Finding

    with console.status(f"checking {endpoint}..."):
        found = check_peer(endpoint)
    if json_output:
        console.print_json({"schema": 1, "peer": found.to_dict()})
    else:
        console.rule("Peer")
        route = (f"{found.local_addr} on {found.interface or 'no interface of its own'}"
                 if found.local_addr else None)
        console.print_pairs([("endpoint", found.endpoint),
                             ("address", f"{found.address} ({found.family})"
                              if found.address else None),
                             ("this node", route)])
        level = "ok" if found.ok else "error"
        _render_finding(Finding(level, found.message, found.hint))
        if found.hostname_on_loopback:
            _render_finding(Finding(
                "info", "this host's name resolves to loopback: torch alone would advertise "
                "127.0.0.1 to the other nodes; fdl run takes the address above from the "
                "routes and exports its interface as GLOO_SOCKET_IFNAME", None))
    if not found.ok:
        raise typer.Exit(1)


def _render(report: DiagnoseReport) -> None:
    from fdl import console

    console.rule("Context")
    console.print_pairs([(k.replace("_", " "), v) for k, v in report.context.items() if v])
    _render_system(report)
    _render_gpus(report)
    _render_torch(report)
    lib = report.libtorch
    console.rule("libtorch")
    console.print_pairs([("active", lib["id"] if lib else "none (fdl setup installs one)"),
                         ("path", lib["path"] if lib else None),
                         ("built with", (f"CUDA {lib['cuda']}" if lib["cuda"] else "CPU only")
                          if lib else None)])
    console.rule("Compatibility")
    advice = report.advice
    if advice.covering:
        labels = ", ".join(c.label for c in advice.covering[:4])
        console.out(f"  official builds covering every GPU: {labels}")
    for finding in report.findings:
        _render_finding(finding)
    console.out()
    _render_finding(report.verdict, prefix="verdict: ")


def _render_finding(finding, *, prefix: str = "") -> None:
    from fdl import console

    word, style = _MARK[finding.level]
    console.out(f"  [{word}] {prefix}{finding.message}", style=style)
    if finding.command:
        console.out(f"         next: {finding.command}", style="bold")


def _render_system(report: DiagnoseReport) -> None:
    from fdl import console

    host = report.host
    console.rule("System")
    where = ", ".join(filter(None, ["WSL" if host.wsl else "",
                                    f"container: {host.container}" if host.container else ""]))
    tools = ", ".join(f"{t.name} {t.version or 'not found'}" for t in host.tools)
    nets = "; ".join(f"{i.name} {' '.join(i.ipv4 + i.ipv6)}" for i in host.interfaces if i.is_up)
    console.print_pairs([
        ("cpu", f"{host.cpu_model} ({host.physical_cores or '?'} physical / "
                f"{host.logical_cores} logical cores)"),
        ("memory", f"{host.ram_mib / 1024:.1f} GiB"),
        ("os", f"{host.os_name} {host.os_release}, kernel {host.kernel}, {host.machine}"
               + (f" ({where})" if where else "")),
        ("python", f"{host.python_version} ({host.python_executable})"),
        ("tools", tools),
        ("network", nets or "no interface up"),
    ])


def _render_gpus(report: DiagnoseReport) -> None:
    from fdl import console

    survey = report.survey
    console.rule(f"GPUs (from {survey.source})")
    console.print_pairs([("driver", survey.driver_version or "none"),
                         ("driver CUDA", survey.cuda_driver_version or "none")])
    if not survey.gpus:
        console.out("  no NVIDIA GPU")
        return
    verdicts = {item.gpu.index: item for item in (report.torch_coverage.gpus
                                                  if report.torch_coverage else ())}
    rows, styles = [], []
    for gpu in survey.gpus:
        item = verdicts.get(gpu.index)
        if item is None:
            status, style = "torch not probed", None
        elif item.driver.status == "too-old":
            status, style = "driver too old", "red"
        else:
            status = {"ok": "ok", "ptx-jit": "ok via PTX JIT", "missing": "MISSING"}[item.kernel.status]
            status += f" ({item.kernel.via})" if item.kernel.via else ""
            style = {"ok": None, "ptx-jit": "yellow", "missing": "red"}[item.kernel.status]
        memory = f"{gpu.memory_mib / 1024:.1f} GiB" if gpu.memory_mib else "?"
        rows.append([gpu.index, gpu.name, f"{gpu.cc} ({gpu.arch})", memory,
                     gpu.pci_bus_id or "", status])
        styles.append(style)
    console.print_table(["#", "name", "compute capability", "memory", "PCI bus",
                         "installed torch"], rows, styles=styles)


def _render_torch(report: DiagnoseReport) -> None:
    from fdl import console

    torch = report.torch
    console.rule("Python torch")
    if not torch.installed:
        console.print_pairs([("torch", f"not installed in {torch.python}")])
        return
    console.print_pairs([
        ("version", torch.version),
        ("built with", f"CUDA {torch.cuda_version}" if torch.cuda_version
         else f"HIP {torch.hip_version}" if torch.hip_version else "CPU only"),
        ("archs", " ".join(torch.arch_list) or "none"),
        ("NCCL", torch.nccl_version or ("available" if torch.nccl_available else "no")),
        ("gloo", "yes" if torch.gloo_available else "no"),
        ("CUDA usable", f"yes ({torch.device_count} device(s))" if torch.cuda_available else "no"),
        ("peer access", ", ".join(f"{i}-{j} {'yes' if ok else 'NO'}"
                                  for i, j, ok in torch.peer_access) or None),
        ("location", torch.path),
        ("probe error", torch.error),
    ])
