# Shared by scripts/test and scripts/demo: create or refresh .venv and install fdl into it with
# the tested versions in scripts/constraints.txt. Source it with EXTRAS set (e.g. "torch,test").
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "error: fdl needs Python >= 3.10 (found: $("$python" --version 2>&1))" >&2
  echo "hint: set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $("$python" --version 2>&1)" >&2
  "$python" -m venv .venv
fi
# Install only when the inputs changed since the last install: the stamp holds their hash.
stamp=.venv/.fdl-install-stamp
want=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)-${EXTRAS}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing fdl[${EXTRAS}] into .venv (pinned by scripts/constraints.txt)" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c scripts/constraints.txt -e ".[${EXTRAS}]"
  echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
