"""Kernel compilation off the path to the first token.

On a machine whose numba cache is empty, compiling the kernels a model needs takes a minute; the
answer need not wait for it. `start(groups)` has the kernel groups compiled in the background, one
after the other in the order given; until a group is ready its callers take an exact path that
needs no compilation (the numpy reference attention; matvecs on the calling thread instead of the
pool) and switch to the compiled one from the first call after `pending` turns False. A later
start loads every kernel from numba's cache in well under a second and the groups are ready almost
at once.

Where: a child process (`python -m engine.kernels.background TARGET...`) compiles the groups into
numba's disk cache (the same cache: the child inherits the environment, NUMBA_CACHE_DIR included)
and reports each one; a thread here then loads it from that cache. A compiling thread in this
process would hold the GIL for most of a minute, and every release of the GIL by the answering
thread (each BLAS call, each kernel call) would then wait for it: the first answer got slower
than compiling everything first. When this process ends first (the child watches its stdin,
which this process holds), the child finishes the groups left at a lower priority and exits:
numba caches a function only once it is compiled, and the decode attention group alone compiles
for over a minute, so a user whose sessions were shorter than that kept starting it over and kept
decoding on the fallback (`OMLX_KERNEL_FINISH=off`: the child ends with its parent, as the test
session wants). Without a child (a frozen app, or the child failed), the thread compiles the
remaining groups itself.

numba compiles under one process-wide lock (its compiler lock), also when it only loads a cached
kernel: a first call of a kernel not compiled yet, in any thread, waits while this process's
background thread compiles or loads. Whatever the foreground calls before a group is ready must
therefore be compiled before `start` (`engine.warmup.start_warm_up` does that).

A group is a name (as the log shows it) and a target "module:function": a function that compiles
or loads the group's kernels by running them once. `status()` tells which groups are ready; the
log (`omlx.kernels`) says when each one became ready and how many calls took the fallback
meanwhile (`count_fallback`).
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("omlx.kernels")

MODE_ENV = "OMLX_KERNEL_COMPILE"  # "process" (default where possible) or "thread": where groups compile
# "on" (default): a compiler process whose parent ended finishes its groups at low priority, so
# that the next start finds them in the cache; "off": it ends with its parent
FINISH_ENV = "OMLX_KERNEL_FINISH"
FINISH_NICE = 10  # the orphaned compiler's niceness increment (where the OS has one)


@dataclass
class _Group:
    name: str
    target: str  # "module:function"
    probes: tuple = ()  # "module:function" of numba dispatchers whose disk cache says it is compiled
    queued: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued, compiling, ready, failed
    fallback_calls: int = 0


_groups: dict[str, _Group] = {}
_lock = threading.Lock()


def _call(target: str) -> None:
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)()


def start(groups: list[tuple[str, str, tuple]]) -> None:
    """Have the groups [(name, "module:function", probes), ...] compiled in the background, in
    this order (names already started are skipped). Returns at once; their callers check
    `pending`. probes: the group's main numba dispatchers ("module:function"); when numba's cache
    holds code for each of them the group is loaded here, without a child process."""
    with _lock:
        new = [_Group(name, target, tuple(probes)) for name, target, probes in groups if name not in _groups]
        for g in new:
            _groups[g.name] = g
    if new:
        threading.Thread(target=_run, args=(new,), name="omlx-kernel-compile", daemon=True).start()


def _child_command(targets: list[str]) -> list[str] | None:
    if getattr(sys, "frozen", False) or os.environ.get(MODE_ENV, "process").strip().lower() == "thread":
        return None
    return [sys.executable, "-m", __name__, *targets]


def _in_cache(probe: str) -> bool:
    """Whether numba's disk cache holds compiled code of this dispatcher for the current sources
    (its cache index, which numba empties when the source stamp changed, has entries)."""
    module, _, name = probe.partition(":")
    try:
        dispatcher = getattr(importlib.import_module(module), name)
        return bool(dispatcher._cache._cache_file._load_index())
    except Exception:  # no cache (caching off, unreadable index): treat as not compiled
        return False


def _run(groups: list[_Group]) -> None:
    todo = list(groups)
    while todo and todo[0].probes and all(_in_cache(p) for p in todo[0].probes):  # a later start: load here
        g = todo.pop(0)
        g.state = "compiling"
        _finish(g, lambda: _call(g.target), "found in numba's cache")
    if not todo:
        return
    # The compilation keeps a core busy for a minute: meanwhile BLAS runs on one thread (a
    # multi-threaded BLAS call ends in a barrier, which waits long for a thread whose core another
    # process holds; a prefill's products were slower than one thread's).
    blas_limit = _limit_blas_threads()
    try:
        cmd = _child_command([g.target for g in todo])
        if cmd is not None:
            todo = _run_child(cmd, todo)
        for g in todo:  # what the child did not compile: here
            g.state = "compiling"
            _finish(g, lambda: _call(g.target), "compiled in a background thread")
    finally:
        if blas_limit is not None:
            blas_limit.restore_original_limits()


def _limit_blas_threads():
    """One BLAS thread until the returned limiter's restore (None when threadpoolctl is missing)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=1, user_api="blas")


def _run_child(cmd: list[str], groups: list[_Group]) -> list[_Group]:
    """Run the child; load each group it reports compiled. Returns the groups it did not do."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the engine package
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: numba's warnings can fill a pipe
    try:
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                                 env=env, text=True)
    except OSError as exc:
        errors.close()
        log.warning("could not start the kernel compiler process (%s); compiling in a thread", exc)
        return groups
    if groups:
        groups[0].state = "compiling"
    done = 0
    for line in child.stdout:
        word, _, rest = line.strip().partition(" ")
        if word not in ("done", "failed"):
            continue
        g = groups[done]
        if word == "failed":
            log.warning("the kernel compiler process failed on the %s kernels: %s", g.name, rest)
            break
        done += 1
        if done < len(groups):
            groups[done].state = "compiling"
        _finish(g, lambda: _call(g.target), "compiled in a child process")  # loads them from the cache
    child.stdout.close()
    rc = child.wait()
    errors.seek(0)
    stderr = errors.read().strip()
    errors.close()
    if done < len(groups):
        log.warning("the kernel compiler process ended (exit code %s) without the %s kernels; compiling "
                    "them in a thread%s", rc, groups[done].name, f": {stderr.splitlines()[-1]}" if stderr else "")
    return groups[done:]


def _finish(g: _Group, load, where: str) -> None:
    t0 = time.perf_counter()
    try:
        load()
        g.state = "ready"
    except Exception:  # the fallback keeps answering; the failure is logged, not raised
        g.state = "failed"
        log.exception("compiling the %s kernels failed; the slower exact path stays in use", g.name)
    if g.state == "ready":
        log.info("%s kernels ready %.2f s after they were queued (%s; %.2f s to load here)%s",
                 g.name, time.perf_counter() - g.queued, where, time.perf_counter() - t0,
                 f"; {g.fallback_calls} calls took the exact fallback meanwhile" if g.fallback_calls else "")
    g.done.set()


def pending(name: str) -> bool:
    """Whether the group `name` was started and is not ready (queued, compiling, or failed): its
    callers take the fallback."""
    g = _groups.get(name)
    return g is not None and g.state != "ready"


def ready(name: str) -> bool:
    """Whether the group `name` was compiled in the background and is ready."""
    g = _groups.get(name)
    return g is not None and g.state == "ready"


def count_fallback(name: str) -> None:
    """Note that a call took the fallback because the group `name` was not ready (for the log)."""
    g = _groups.get(name)
    if g is not None:
        g.fallback_calls += 1


def wait(timeout: float | None = None) -> bool:
    """Wait until every started group is done (ready or failed); False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for g in list(_groups.values()):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not g.done.wait(left):
            return False
    return True


def status() -> str:
    """One line: each started group and its state."""
    if not _groups:
        return "no background compilation"
    return ", ".join(f"{g.name}: {g.state}" for g in _groups.values())


_first_token_noted = False


def note_first_token(ttft_s: float) -> None:
    """Log, once per process, when its first generated token came (after the request and after
    the process started) and which kernel groups were ready for it: the paths that answered."""
    global _first_token_noted
    if _first_token_noted:
        return
    _first_token_noted = True
    since_start = ""
    try:
        import psutil

        process = psutil.Process()
        cpu = process.cpu_times()
        since_start = (f", {time.time() - process.create_time():.1f} s after the process started "
                       f"({cpu.user + cpu.system:.1f} s of CPU time)")
    except Exception:  # psutil missing or the process table unreadable: the request time alone
        pass
    waiting = [g.name for g in _groups.values() if g.state != "ready"]
    log.info("first token %.2f s after its request%s; %s", ttft_s, since_start,
             f"exact fallbacks answered for the kernels not ready yet ({status()})" if waiting
             else "all kernels were ready" if _groups else "kernels compiled or loaded before the first request")


def _child_main(targets: list[str]) -> int:
    """The compiler process: compile each target in order, print "done i" or "failed i message".
    When the parent closes our stdin (it ended): finish the targets at a lower priority, saying
    nothing more (FINISH_ENV "on"), or exit at once ("off")."""
    finish = os.environ.get(FINISH_ENV, "on").strip().lower() != "off"
    orphaned = threading.Event()

    def watch_parent():
        sys.stdin.read()
        if not finish:
            os._exit(0)
        orphaned.set()
        # the main thread compiles; on Linux a priority is per thread and PRIO_PROCESS with the
        # process id names the main one (os.nice here would lower only this thread)
        if hasattr(os, "setpriority"):
            try:
                pid = os.getpid()
                os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, pid) + FINISH_NICE))
            except OSError:  # not permitted here: finish at the priority we have
                pass

    def report(line: str) -> None:
        if orphaned.is_set():
            return
        try:
            print(line, flush=True)
        except (BrokenPipeError, ValueError):  # the parent is gone and took the pipe
            orphaned.set()

    threading.Thread(target=watch_parent, daemon=True).start()
    code = 0
    for i, target in enumerate(targets):
        try:
            _call(target)
        except Exception as exc:  # reported to the parent, which compiles the rest itself
            report(f"failed {i} {type(exc).__name__}: {exc}".replace("\n", " "))
            code = 1
            break
        report(f"done {i}")
    if orphaned.is_set():  # stdout's pipe is gone: the exit's flush of a line a failed write
        os._exit(code)  # left in its buffer would print a BrokenPipeError
    return code


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
