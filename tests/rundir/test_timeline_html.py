"""timeline.html: self-contained (no URL anywhere), the document embedded so that no string in it
can break out of its <script> block, and — where Chromium is installed — a page that draws
without a script error (scripts/check-timeline-html, which must also reject a broken page)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fdl.rundir.timeline_html import embed_json, render_html
from fdl.rundir.timeline_merge import merge_timeline

CHECKER = Path(__file__).resolve().parents[2] / "scripts" / "check-timeline-html"
HOSTILE = "</script><script>alert(1)</script> & \u2028 <!--"


def make_doc(tmp_path: Path) -> dict:
    """A small real run: two ranks, a restart, an anchor change, samples with a GPU."""
    timeline = tmp_path / "run" / "timeline"
    timeline.mkdir(parents=True)
    for rank in range(2):
        events = [{"t": 100.0, "rank": rank, "kind": "start", "attempt": 0}]
        for number in range(40):
            end = 100.0 + (number + 1) * 0.5
            events += [{"t": end - 0.1, "rank": rank, "kind": "round", "round": number,
                        "compute_s": 0.3 + 0.05 * rank, "data_s": 0.05},
                       {"t": end, "rank": rank, "kind": "sync", "round": number,
                        "wait_s": 0.08}]
        events += [{"t": 110.0, "rank": rank, "kind": "anchor", "anchor": 6, "previous": 4},
                   {"t": 112.0, "rank": rank, "kind": "start", "attempt": 1},
                   {"t": 118.0, "rank": rank, "kind": "epoch", "epoch": 1},
                   {"t": 119.0, "rank": rank, "kind": "checkpoint", "name": HOSTILE}]
        events.sort(key=lambda e: e["t"])
        (timeline / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    samples = [{"t": 100.0 + i * 0.1, "node": 0, "host": "box", "cpu_percent": float(i % 100),
                "ram_used_bytes": 3, "ram_total_bytes": 8,
                "gpus": [{"cuda_index": 0, "util_percent": 50.0, "mem_used_bytes": 1,
                          "mem_total_bytes": 4}]} for i in range(200)]
    (timeline / "samples-node0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (tmp_path / "run" / "summary.json").write_text(json.dumps(
        {"policy": "async", "backend": "cpu", "world_size": 2, "wall_s": 20.0,
         "throughput": {"samples_per_s": 10.0}, "eval": {"accuracy": 0.9}, "final_loss": 0.1}))
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(
        {"epoch": 1, "samples": 100, "train_loss": 0.3, "eval": {"accuracy": 0.9}}) + "\n")
    return merge_timeline(tmp_path / "run")


def embedded(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="fdl-data">(.*?)</script>', page,
                      re.DOTALL)
    assert match is not None
    return json.loads(match.group(1))


def test_page_loads_nothing_from_outside(tmp_path):
    page = render_html(make_doc(tmp_path), title="fdl timeline — run")
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(", page)


def test_document_is_embedded_and_cannot_break_out_of_its_script_block(tmp_path):
    doc = make_doc(tmp_path)
    page = render_html(doc, title="<b>run</b> & co")
    assert embedded(page) == doc
    checkpoint = next(e for e in embedded(page)["events"] if e["kind"] == "checkpoint")
    assert checkpoint["name"] == HOSTILE
    assert "<script>alert(1)" not in page and "\u2028" not in page
    assert page.count("</script>") == 3  # the error hook, the data block, the page's script
    assert "<title>&lt;b&gt;run&lt;/b&gt; &amp; co</title>" in page


def test_non_finite_numbers_become_null_so_javascript_can_parse_them():
    text = embed_json({"loss": float("nan"), "xs": [1.0, float("inf")], "ok": 2.5})
    assert json.loads(text) == {"loss": None, "xs": [1.0, None], "ok": 2.5}
    assert "NaN" not in text and "Infinity" not in text


def check_in_browser(html: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium not installed: apt-get install chromium (the CI script installs it)")
    why = _cannot_run(binary)
    if why:
        pytest.skip(f"chromium is installed but cannot run headless here: {why}")
    return subprocess.run([sys.executable, str(CHECKER), str(html)], capture_output=True,
                          text=True, timeout=300)


def _cannot_run(binary: str) -> str:
    """Why this host's chromium cannot load a trivial page headless ("" when it can): a broken
    browser install is the host's problem, not the page's, and is reported as a skip."""
    argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--dump-dom", "data:text/html,<p>fdl-probe</p>"]
    try:
        probe = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if "fdl-probe" in probe.stdout:
        return ""
    return f"exit {probe.returncode}: " + (probe.stderr.strip().splitlines() or ["no output"])[-1]


def test_page_draws_in_chromium_without_errors(tmp_path):
    html = tmp_path / "timeline.html"
    html.write_text(render_html(make_doc(tmp_path), title="fdl timeline — run"))
    result = check_in_browser(html)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")


def test_checker_rejects_a_page_whose_script_fails(tmp_path):
    broken = {**make_doc(tmp_path), "ranks": 5}  # not a list: the page's script throws
    html = tmp_path / "timeline.html"
    html.write_text(render_html(broken, title="broken"))
    result = check_in_browser(html)
    assert result.returncode == 1
    assert "script errors" in result.stderr and "data-fdl-status: error" in result.stderr
