#!/usr/bin/env bash
# The project's full test command: the pinned torch, the package with its test extras, Debian's
# Chromium for the browser test (tests/server/test_web_ui.py), ruff, then pytest in two worker
# processes (pytest-xdist; one test file per worker at a time, so a file's fixtures load once).
# Each worker's torch gets its share of the cores (tests/conftest.py): OpenMP threads outnumbering
# the cores slow each other's steps many times over. Tests of how kernels share their work between
# threads choose their thread counts themselves. The files that take longest go first
# (tests/conftest.py, LONGEST_FILES). Extra arguments go to pytest.
#   scripts/test.sh                      # everything
#   scripts/test.sh tests/server -x      # a subset
#   scripts/test.sh -n 0                 # in one process
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install torch==2.13.0
python -m pip install -e ".[test]"

# Playwright drives the system Chromium; `playwright install` (which downloads browsers) is not used.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -eq 0 ]; then SUDO=(); else SUDO=(sudo); fi
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi

# Lint and format first (pyproject.toml's [tool.ruff]): seconds, and a clear first failure.
python -m ruff check .
python -m ruff format --check .

python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 "$@"
