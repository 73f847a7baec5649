"""fdl.system.facts.torch_build / machine_facts: torch's version and CUDA version without
importing torch (``fdl compare`` asks once its runs are done; the import costs about a second),
in real child interpreters: this venv's wheel, a stand-in CUDA wheel, and a broken one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, sys
    from fdl.system.facts import machine_facts, torch_build
    facts = machine_facts()
    print(json.dumps({"build": torch_build(), "machine": [facts["torch"], facts["cuda"]],
                      "imported": "torch" in sys.modules}))
""")


def _probe(*, path_first: str | None = None) -> dict:
    env_path = [path_first] if path_first else []
    code = f"import sys; sys.path[:0] = {env_path!r}\n{PROBE}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    return json.loads(done.stdout)


def test_the_installed_wheel_is_read_without_importing_it():
    pytest.importorskip("torch")
    truth = subprocess.run([sys.executable, "-c", "import json, torch; print(json.dumps("
                            "[torch.__version__, torch.version.cuda]))"],
                           capture_output=True, text=True, check=True, timeout=120)
    got = _probe()
    assert got["imported"] is False
    assert [got["build"]["torch"], got["build"]["cuda"]] == json.loads(truth.stdout)
    assert got["machine"] == json.loads(truth.stdout)


@pytest.mark.parametrize(("version_py", "expected"), [
    ("from typing import Optional\n__version__ = '2.9.0+cu128'\ndebug = False\n"
     "cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", ["2.9.0+cu128", "12.8"]),
    ("__version__ = '2.9.0'\ncuda = None\n", ["2.9.0", None]),
    ("__version__ = compute()\ncuda = 12.8\n", [None, None]),  # not string literals: unknown
    ("def broken(:\n", [None, None]),
    (b"\xff\xfe not text", [None, None]),
], ids=["cuda wheel", "cpu wheel", "not literals", "syntax error", "not utf-8"])
def test_a_wheel_on_the_path_is_read_from_its_version_py(tmp_path, version_py, expected):
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported torch')\n")
    data = version_py if isinstance(version_py, bytes) else version_py.encode()
    (package / "version.py").write_bytes(data)
    got = _probe(path_first=str(tmp_path))
    assert got["imported"] is False
    assert [got["build"]["torch"], got["build"]["cuda"]] == expected
