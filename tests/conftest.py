"""Shared fixtures.

* every test starts without fdl's, torchelastic's and torchrun's variables (autouse), and a
  liveness thread it started in this process stops with it (autouse);
* ``flodl_home``: an empty FLODL_HOME in tmp_path, ``store``: the libtorch store in it;
* ``http_server``: a real HTTP server on 127.0.0.1 (port 0) that can be told to misbehave
  (statuses, cut connections, delays, pauses until released, redirects), for download tests.
  Plain http needs the opt-in (``FDL_ALLOW_HTTP=1`` or ``allow_http=True``) wherever fdl
  fetches from it;
* ``mirror_env``: the environment for an `fdl` subprocess whose libtorch catalog is that server.

Subprocesses get the same scrubbed environment from ``helpers.clean_env``.

``--deselect-gpu REASON`` (scripts/test passes it when torch sees no CUDA GPU) deselects the
tests marked ``gpu`` and prints one line with how many and why; without it they skip.

On pytest-xdist's workers (scripts/test runs two test files at a time) a test marked ``alone``
runs with no other test beside it: it reads how fast real workers ran (emulated slowdowns,
the plan's shares, a schedule's last step), which another test's processes on the same cores
would change. Each test takes a lock file that the whole run shares, ``alone`` ones
exclusively, the others shared; a turnstile before it keeps a waiting ``alone`` test from
being passed by the next ones."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import pytest
from helpers import GPU_FIXTURES

from fdl.settings import is_launcher_variable

if TYPE_CHECKING:
    from fdl.libtorch.store import Store


_GPU_DESELECTED = pytest.StashKey[int]()
_GPU_DESELECTED_BY_WORKERS = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--deselect-gpu", metavar="REASON", default=None,
                     help="deselect the tests marked gpu and say so, with REASON (scripts/test "
                          "passes it when torch sees no CUDA GPU)")


@pytest.hookimpl(trylast=True)  # after -m: count only the gpu tests that would have run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--deselect-gpu") is None:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
        config.hook.pytest_deselected(items=gpu)
    config.stash[_GPU_DESELECTED] = len(gpu)
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller says it
        config.workeroutput["gpu_deselected"] = len(gpu)


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    if config.getoption("--deselect-gpu") is None or _GPU_DESELECTED not in config.stash:
        return []  # under pytest-xdist the workers collect: the summary says it (below)
    return [_gpu_line(config, config.stash[_GPU_DESELECTED])]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain pytest has none
def pytest_testnodedown(node, error) -> None:
    count = getattr(node, "workeroutput", {}).get("gpu_deselected")
    if count is not None:  # every worker collects every test: any one's count is the count
        node.config.stash[_GPU_DESELECTED_BY_WORKERS] = count


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    count = config.stash.get(_GPU_DESELECTED_BY_WORKERS, None)
    if count is not None and config.getoption("--deselect-gpu") is not None:
        terminalreporter.write_line(_gpu_line(config, count))


def _gpu_line(config: pytest.Config, count: int) -> str:
    return (f"==> pytest: {count} gpu test{'' if count == 1 else 's'} deselected: "
            f"{config.getoption('--deselect-gpu')} (scripts/test-gpu runs them)")


_ALONE_LOCKS = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller, as it starts each worker
def pytest_configure_node(node) -> None:
    if _ALONE_LOCKS not in node.config.stash:
        node.config.stash[_ALONE_LOCKS] = tempfile.mkdtemp(prefix="fdl-tests-")
    node.workerinput["alone_locks"] = node.config.stash[_ALONE_LOCKS]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ALONE_LOCKS in config.stash:  # the controller, once every worker is done
        shutil.rmtree(config.stash[_ALONE_LOCKS], ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The test's turn, around its setup (module fixtures included), call and teardown."""
    folder = getattr(item.config, "workerinput", {}).get("alone_locks")
    if folder is None:  # one process runs every test: nothing runs beside any
        return (yield)
    with alone_turn(folder, alone=item.get_closest_marker("alone") is not None):
        return (yield)


@contextlib.contextmanager
def alone_turn(folder: str, *, alone: bool) -> Iterator[None]:
    with open(os.path.join(folder, "turnstile"), "a") as turnstile, \
            open(os.path.join(folder, "tests"), "a") as tests:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(tests, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def no_launcher_variables(monkeypatch):
    """Remove every variable ``fdl.settings.is_launcher_variable`` names (``FDL_*``,
    ``TORCHELASTIC_*``, ``RANK``, ``WORLD_SIZE``, ...) for the test's length: a value from the
    shell that started pytest (or from an ``fdl run`` around it) would otherwise change what an
    in-process Trainer or resolver does. A test that wants one sets it with monkeypatch."""
    for name in [name for name in os.environ if is_launcher_variable(name)]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def no_liveness_left() -> Iterator[None]:
    """Stop the liveness thread a test started in this process (``ElasticSignal``,
    ``SharedPool``: fdl.engine.liveness) with the test: left ticking on the test's store, it
    hit the store once the test had closed it, c10d printed a warning and a stack into a later
    test's output, and the thread lived on until then."""
    yield
    module = sys.modules.get("fdl.engine.liveness")
    if module is not None:
        module.stop_ticking()


@pytest.fixture
def flodl_home(tmp_path, monkeypatch) -> Path:
    """FLODL_HOME, empty, in tmp_path (set in this process too: in-process code never reaches
    the user's home); pass it on to a subprocess as ``FLODL_HOME``."""
    home = tmp_path / "flodl-home"
    monkeypatch.setenv("FLODL_HOME", str(home))
    return home


@pytest.fixture
def store(flodl_home) -> Store:
    """The libtorch store of ``flodl_home``, empty."""
    from fdl.libtorch.store import Store

    return Store(flodl_home / "libtorch")


@dataclass
class Act:
    """How to answer one request; fields left unset mean "behave"."""

    status: int | None = None  # answer this status (with a short body) instead of the file
    cut_after: int | None = None  # send this many body bytes, then drop the connection
    delay_s: float = 0.0  # wait this long after the headers, before the body
    pause_after: int | None = None  # send this many body bytes, then wait for ``release``
    drip_s: float | None = None  # send the body a byte at a time, this long apart (a drip)
    release: threading.Event = field(default_factory=threading.Event)  # set it to go on


@dataclass
class FileServer:
    """What the handler serves and how; tests set the switches and read ``requests``."""

    Act: ClassVar[type[Act]] = Act  # so tests build acts without importing this conftest
    files: dict[str, bytes] = field(default_factory=dict)
    script: deque[Act] = field(default_factory=deque)  # one Act per request, first in first out
    default: Act = field(default_factory=Act)  # once the script is used up
    ignore_range: bool = False  # answer 200 with the whole file even when asked for a range
    # (and offer no ranges: no Accept-Ranges); otherwise a strong ETag from the file's bytes
    validators: bool = True  # send ETag and Accept-Ranges (ranged downloads need a validator)
    claim_ranges: bool = False  # with ignore_range: offer ranges all the same, then ignore them
    on_request: Callable[[int], None] | None = None  # called with each request's 0-based number
    statuses: list[int] = field(default_factory=list)  # of the file's answers, as sent
    sent: list[tuple[int, int]] = field(default_factory=list)  # (status, body bytes written)
    redirects: dict[str, str] = field(default_factory=dict)  # path -> Location of a 302
    requests: list[dict[str, str | None]] = field(default_factory=list)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def next_act(self, path: str, range_header: str | None) -> Act:
        self.requests.append({"path": path, "range": range_header})
        if self.on_request is not None:
            self.on_request(len(self.requests) - 1)
        return self.script.popleft() if self.script else self.default


def _handler(server_state: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # keep pytest output clean
            pass

        def do_GET(self):
            act = server_state.next_act(self.path, self.headers.get("Range"))
            location = server_state.redirects.get(self.path.lstrip("/"))
            if location is not None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = server_state.files.get(self.path.lstrip("/"))
            if act.status is not None or data is None:
                self._answer_error(act.status or 404)
                return
            etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"'
            span = self._range_span(len(data))
            if_range = self.headers.get("If-Range")
            if span is None or server_state.ignore_range or (if_range and if_range != etag):
                status, (start, end) = 200, (0, len(data))
            else:
                status, (start, end) = 206, span
            server_state.statuses.append(status)
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            if server_state.validators and (server_state.claim_ranges
                                            or not server_state.ignore_range):
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", etag)
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            time.sleep(act.delay_s)
            sent = self._send_body(data[start:end], act)
            server_state.sent.append((status, sent))

        def _range_span(self, size: int) -> tuple[int, int] | None:
            """[start, end) of ``Range: bytes=a-`` or ``bytes=a-b``."""
            spec = self.headers.get("Range")
            if not spec or not spec.startswith("bytes="):
                return None
            first, _, last = spec[len("bytes="):].partition("-")
            return int(first), min(size, int(last) + 1) if last else size

        def _answer_error(self, status: int) -> None:
            body = f"error {status}\n".encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _send_body(self, body: bytes, act: Act) -> int:
            """Write ``body`` as ``act`` says; returns the bytes written."""
            sent = 0
            if act.pause_after is not None:
                self.wfile.write(body[:act.pause_after])
                self.wfile.flush()
                sent = min(len(body), act.pause_after)
                act.release.wait(timeout=120)  # a guard: the test sets it
                body = body[act.pause_after:]
            if act.drip_s is not None:  # until the client hangs up (BrokenPipe ends the handler)
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    sent += 1
                    time.sleep(act.drip_s)
                return sent
            if act.cut_after is not None:
                self.wfile.write(body[:act.cut_after])
                self.wfile.flush()
                self.close_connection = True  # the client sees a body shorter than promised
                return sent + min(len(body), act.cut_after)
            for i in range(0, len(body), 1 << 16):
                self.wfile.write(body[i:i + (1 << 16)])
                sent += len(body[i:i + (1 << 16)])
            return sent

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that hung up on a slow answer
        pass


@pytest.fixture
def http_server():
    """A ``FileServer`` listening on a free port on 127.0.0.1 for the length of one test."""
    state = FileServer()
    server = _QuietServer(("127.0.0.1", 0), _handler(state))
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def mirror_env(http_server, tmp_path) -> dict[str, str]:
    """``env`` for ``helpers.run_fdl``: FLODL_HOME in tmp_path (not created), the libtorch
    catalog on ``http_server`` (FDL_LIBTORCH_MIRROR, plain http opted in: it is 127.0.0.1) and a
    host without GPUs (FDL_GPU_SURVEY), so that `fdl setup` picks the CPU build. Tests put the
    archives they want fetched in ``http_server.files``."""
    return {"FLODL_HOME": str(tmp_path / "home"), "FDL_LIBTORCH_MIRROR": http_server.url(""),
            "FDL_ALLOW_HTTP": "1", "FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json")}


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], Path]]:
    """``read_only(folder)``: ``folder`` bind-mounted read-only over itself (what root cannot
    write either) until the test ends."""
    mounted: list[Path] = []

    def make(folder: Path) -> Path:
        first = subprocess.run(["mount", "--bind", str(folder), str(folder)],
                               capture_output=True, text=True)
        if first.returncode != 0:
            pytest.skip(f"a read-only bind mount needs root (CAP_SYS_ADMIN): {first.stderr}")
        mounted.append(folder)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True,
                       capture_output=True)
        return folder

    yield make
    for folder in reversed(mounted):
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)
