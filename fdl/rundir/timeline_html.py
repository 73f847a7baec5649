"""``timeline/timeline.html``: a run's merged timeline (:mod:`fdl.rundir.timeline_merge`) as one
self-contained page — open it from disk, mail it, attach it to an issue; it loads nothing.

The page (``templates/timeline.html.tmpl``: inline CSS and JavaScript drawing on canvas) shows a
header from ``summary.json`` (policy, world size, wall time, throughput, eval; or that the run
did not finish), one swimlane per rank coloured by compute / emulated (the slowdown emulation's
sleep) / data / sync / idle, event markers
with hover tooltips (epoch ends as dashed lines across the lanes, anchor changes, guard
halvings, checkpoints, starts, restarts in red), a utilisation panel (CPU %, RAM % and each
GPU's util % and memory % per node, when samples were recorded) and a table of the epochs.
Wheel zooms around the pointer, dragging zooms to the range, shift+wheel or the arrow keys pan,
double-click, ``0`` or the button resets. Spans narrower than a pixel are summed per pixel
column, so an hour-long run with tens of thousands of rounds stays legible and fast.

The document is embedded as JSON in a ``<script type="application/json">`` block with ``<``,
``>``, ``&`` and the JavaScript line separators escaped, so no string in it (a host name, a
checkpoint name) can end the block or inject markup. After drawing, the page sets
``data-fdl-status="rendered"`` on ``<body>``; any script error is written into
``<pre id="fdl-errors">`` and sets the status to ``error`` (scripts/check-timeline-html reads
both).
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from typing import Any

from fdl.files import finite_json

_TOKEN = re.compile(r"__FDL_(TITLE|DATA)__")
_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
           "\u2029": "\\u2029"}


def render_html(doc: dict[str, Any], *, title: str) -> str:
    """The self-contained HTML page for a merged timeline document."""
    template = (resources.files("fdl.rundir") / "templates" / "timeline.html.tmpl").read_text(
        encoding="utf-8")
    values = {"TITLE": html.escape(title), "DATA": embed_json(doc)}
    # One pass, so a title or a value in the data that happens to spell a token stays as it is.
    return _TOKEN.sub(lambda match: values[match.group(1)], template)


def embed_json(value: Any) -> str:
    """``value`` as JSON that is safe inside an HTML ``<script>`` element and that JavaScript's
    ``JSON.parse`` accepts (:func:`strict_json`)."""
    return re.sub("[<>&\u2028\u2029]", lambda match: _UNSAFE[match.group(0)], strict_json(value))


def strict_json(value: Any) -> str:
    """Compact JSON that strict parsers (JavaScript's ``JSON.parse``) accept: NaN and the
    infinities, which Python writes but JSON has not (a diverged loss), become null.

    It lives here, with the page that needs it, and :mod:`fdl.rundir.timeline_merge` writes
    ``timeline.json`` with it too, so the file and the embedded document are the same JSON."""
    try:
        return json.dumps(value, separators=(",", ":"), default=str, allow_nan=False)
    except ValueError:  # rare: pay for the walk only then
        return json.dumps(finite_json(value), separators=(",", ":"), default=str, allow_nan=False)


