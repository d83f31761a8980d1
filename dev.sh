#!/usr/bin/env bash
# The README's Quick start: `./dev.sh demo` runs the main job, `./dev.sh test` runs the whole suite
# (the docs' code examples included); `./dev.sh docs` builds the docs site strictly.
# Both create (once) and reuse a project-local virtual environment in .venv; nothing needs to be
# installed by hand first on a Debian/Ubuntu machine with Python 3.11+.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=${PYTHON:-python3}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

apt_install() {
  command -v apt-get >/dev/null || return 1
  [ -f /tmp/.safeio-apt-updated ] || { as_root apt-get update -qq && touch /tmp/.safeio-apt-updated; } || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_fuse() {
  # fusermount3 and libfuse3 let the NFS-like test filesystem mount; without them FUSE tests skip
  # (or fail under SAFEIO_REQUIRE_FUSE=1, as in CI).
  if ! command -v fusermount3 >/dev/null || ! ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so'; then
    echo "dev.sh: installing fuse3 (NFS-like test filesystem)" >&2
    apt_install fuse3 || echo "dev.sh: could not install fuse3; FUSE tests will be skipped" >&2
  fi
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "dev.sh: creating $VENV" >&2
    if ! "$PY" -m venv "$VENV" 2>/dev/null; then
      rm -rf "$VENV"
      pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      apt_install "python${pyver}-venv" || apt_install python3-venv
      "$PY" -m venv "$VENV"
    fi
  fi
  # Reinstall only when the project's requirements changed.
  stamp="$VENV/.safeio-stamp"
  want=$(cat pyproject.toml setup.py safeio/_autopatch/safeio-autopatch.pth dev.sh | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev.sh: installing safeio and its test dependencies into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned: on the CI machine kind torch==2.13.0 is a local CPU build, and an
    # unpinned torch would pull a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    # The distribution was called "safeio" before it became safeio-ckpt (the name "safeio" on the
    # package index is another project): an old editable install must go, or two distributions
    # would own the safeio package, its script and its start-up hook.
    if "$VENV/bin/python" -m pip show -q safeio >/dev/null 2>&1; then
      "$VENV/bin/python" -m pip uninstall -q -y safeio
    fi
    rm -rf safeio.egg-info  # its metadata in the checkout: importlib.metadata would still list "safeio"
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
  fi
}

run_with_burners() {
  # Runs "$@" with $1 busy CPU burners beside it and ends them by their pids when it ends, whatever
  # happens (a failure, Ctrl-C, a TERM, which is passed on to the command). A burner also stops by
  # itself once this shell is gone (even SIGKILLed): it watches its parent, so none outlives the run.
  local n=$1 pids=() i child code=0
  shift
  for ((i = 0; i < n; i++)); do
    "$VENV/bin/python" -c '
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(200_000):
        pass
' &
    pids+=($!)
  done
  # shellcheck disable=SC2317 # called through the trap
  stop_burners() { [ ${#pids[@]} -eq 0 ] || { kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; } || true; pids=(); }
  trap stop_burners EXIT
  echo "dev.sh: $n CPU burner(s) running beside the suite (pids ${pids[*]:-none})" >&2
  local started=$SECONDS
  # In the background so that a TERM reaches this shell's trap at once (a foreground child defers
  # it); Ctrl-C restored for the command (a background job may start with SIGINT ignored).
  ( trap - INT; exec "$@" ) &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null' TERM
  trap 'kill -INT "$child" 2>/dev/null' INT
  while :; do
    code=0
    wait "$child" || code=$?
    kill -0 "$child" 2>/dev/null || break  # a signal interrupted the wait, not the command's end
  done
  stop_burners
  trap - INT TERM EXIT
  echo "dev.sh: finished in $((SECONDS - started)) s beside $n burner(s); exit code $code" >&2
  return $code
}

cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    ensure_fuse; ensure_venv
    exec "$VENV/bin/safeio" demo "$@" ;;
  test)
    ensure_fuse; ensure_venv
    # `./dev.sh test --stress N [pytest args]`: the suite with N busy CPU burners beside it, as on a
    # shared, loaded CI runner (issue 37: bounds that load could exceed failed there and nowhere else).
    if [ "${1:-}" = --stress ] || [[ "${1:-}" == --stress=* ]]; then
      if [ "$1" = --stress ]; then burners=${2:-}; shift 2 || shift; else burners=${1#--stress=}; shift; fi
      [[ "$burners" =~ ^[0-9]+$ ]] || { echo "dev.sh: --stress takes a number of CPU burners" >&2; exit 2; }
      run_with_burners "$burners" "$VENV/bin/python" -m pytest "$@"
      exit $?
    fi
    exec "$VENV/bin/python" -m pytest "$@" ;;
  lint)
    ensure_venv
    paths=$(ls -d safeio tests examples benchmarks scripts 2>/dev/null || true)
    # shellcheck disable=SC2086 # one word per directory
    "$VENV/bin/ruff" check $paths
    # shellcheck disable=SC2086
    "$VENV/bin/ruff" format --check $paths
    exec "$VENV/bin/mypy" ;;
  bench)
    ensure_fuse; ensure_venv
    exec "$VENV/bin/python" -m benchmarks "$@" ;;
  docs)
    # The docs site, built strictly: a warning (a broken link, a docstring mkdocstrings cannot read)
    # fails the build. `./dev.sh docs serve` previews it on http://127.0.0.1:8000.
    ensure_venv
    export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about its successor, not about these docs
    if [ "${1:-}" = serve ]; then shift; exec "$VENV/bin/mkdocs" serve --strict "$@"; fi
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    "$VENV/bin/mkdocs" build --strict --site-dir "$site" "$@"
    echo "dev.sh: docs built (strict) into $site, removed" >&2 ;;
  *)
    echo "usage: ./dev.sh demo|test [--stress N]|lint|bench|docs [args...]" >&2; exit 2 ;;
esac
