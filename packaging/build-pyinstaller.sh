#!/usr/bin/env bash
# Builds the one-folder app with PyInstaller into packaging/dist/omlx-desktop/ and starts it once
# headless (QT_QPA_PLATFORM=offscreen) to check that it runs.
#
#   packaging/build-pyinstaller.sh [--no-smoke]
#
# Needs the repo's venv (.venv, README step 1); installs pyinstaller into it. Work files go to
# packaging/build/, the result to packaging/dist/ (both ignored by git).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
py=$repo/.venv/bin/python
smoke=1
for arg in "$@"; do
    case $arg in
        --no-smoke) smoke=0 ;;
        -h|--help) sed -n '2,8s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done
[ -x "$py" ] || { echo "error: no venv at $repo/.venv (README step 1)" >&2; exit 1; }

cd "$repo"
echo "== pyinstaller"
"$py" -m pip install --quiet --disable-pip-version-check "pyinstaller>=6.10"

echo "== build"
"$py" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath "$here/dist" --workpath "$here/build" "$here/omlx-desktop.spec"
app=$here/dist/omlx-desktop/omlx-desktop
[ -x "$app" ] || { echo "error: the build left no $app" >&2; exit 1; }
echo "built $app ($(du -sh "$here/dist/omlx-desktop" | cut -f1))"

[ "$smoke" = 1 ] || exit 0

echo "== smoke test (offscreen)"
# A model given by path: the frozen app must not try to fetch one (fetching runs
# `sys.executable -m pip`, and sys.executable is the app itself when frozen).
model=$("$repo/.venv/bin/omlx" models path smollm2-135m-instruct 2>/dev/null || true)
[ -f "$model" ] || model=$here/build/no-model.gguf
log=$here/build/smoke.log
export QT_QPA_PLATFORM=offscreen
if grep -q -- "--smoke-test" "$repo/omlx_desktop/app.py"; then
    # The app shows its window, then quits with 0 (or non-zero on an error) by itself.
    if timeout 120 "$app" --smoke-test "$model" >"$log" 2>&1; then
        echo "smoke test passed (--smoke-test exited 0)"
    else
        rc=$?
        echo "smoke test FAILED (exit $rc); output:" >&2
        cat "$log" >&2
        exit 1
    fi
else
    # No --smoke-test flag yet: the app passes if it is still running after 20 s with no
    # traceback on stderr; then it is stopped.
    "$app" "$model" >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 20); do
        sleep 1
        kill -0 "$pid" 2>/dev/null || break
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        if grep -q "Traceback" "$log"; then
            echo "smoke test FAILED: a traceback while running:" >&2
            cat "$log" >&2
            exit 1
        fi
        echo "smoke test passed (ran 20 s without errors; app.py has no --smoke-test flag)"
    else
        wait "$pid" && rc=0 || rc=$?
        echo "smoke test FAILED: the app exited with $rc within 20 s; output:" >&2
        cat "$log" >&2
        exit 1
    fi
fi
