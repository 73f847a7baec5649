"""Stand-in for PyTorch's ``tools/build_libtorch.py``: seconds instead of hours.

Committed as ``tools/build_libtorch.py`` into a throw-away git repo by
``tests/libtorch/test_build.py``. Like the real script it takes ``--cmake-only`` and
``--rerun-cmake``, reads the build settings from the environment and installs into
``<repo>/torch/{lib,include,share}``. ``STANDIN_MODE`` picks the outcome: ``ok`` (default),
``fail`` (exit 3 after some output) or ``no-cmake-config`` (share/cmake/Torch without TorchConfig.cmake).
"""

import argparse
import os
import sys
from pathlib import Path

REQUIRED = ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "USE_CUDA", "USE_CUDNN", "USE_NCCL",
            "USE_DISTRIBUTED", "BUILD_PYTHON", "BUILD_TEST")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cmake-only", action="store_true")
    parser.add_argument("--rerun-cmake", action="store_true")
    args = parser.parse_args()
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        print(f"stand-in: missing environment: {' '.join(missing)}", flush=True)
        return 2
    root = Path(__file__).resolve().parent.parent
    cache = root / "build" / "CMakeCache.txt"
    if args.cmake_only:
        cache.parent.mkdir(exist_ok=True)
        cache.write_text(f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}\n")
        print(f"-- stand-in configured for {os.environ['TORCH_CUDA_ARCH_LIST']}", flush=True)
        return 0
    if not cache.is_file():
        print("stand-in: not configured (no build/CMakeCache.txt)", flush=True)
        return 4
    runs = root / "build" / "runs"
    count = int(runs.read_text()) + 1 if runs.is_file() else 1
    runs.write_text(str(count))
    print(f"[1/3] stand-in build run {count} with MAX_JOBS={os.environ['MAX_JOBS']}", flush=True)
    print("[2/3] stand-in linking (on stderr)", file=sys.stderr, flush=True)
    mode = os.environ.get("STANDIN_MODE", "ok")
    if mode == "fail":
        print("error: stand-in compiler failure", flush=True)
        return 3
    torch = root / "torch"
    config = "TorchConfigVersion.cmake" if mode == "no-cmake-config" else "TorchConfig.cmake"
    for path in ("lib/libtorch_cpu.so", "include/torch/x.h", f"share/cmake/Torch/{config}"):
        (torch / path).parent.mkdir(parents=True, exist_ok=True)
        (torch / path).write_text(f"stand-in {path}\n")
    print("[3/3] stand-in installed into torch/", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
