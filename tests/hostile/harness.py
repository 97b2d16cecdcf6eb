"""Run `ckptflow` commands on hostile inputs, each one bounded in time, memory and disk, quickly.

Starting the CLI costs about a second (typer, rich, fsspec, numpy; three with torch for `--deep`), too
much for thousands of runs. So a *zygote* process imports the CLI and everything its commands use
once, then forks one child per command. Every child is a real process of its own, as `ckptflow`
started from a shell would be, with nothing shared but the imported modules:

- its own stdout and stderr (files), stdin from /dev/null, its own working directory and
  environment, its own process group;
- `RLIMIT_AS`: the zygote's address space plus `Limits.memory` (an allocation past it fails with
  MemoryError, so a memory blow-up is an error, not a machine in trouble);
- `RLIMIT_FSIZE`: no file larger than `Limits.file_size` (SIGXFSZ ignored, so a write past it fails
  with EFBIG the way a full disk fails a write), and `RLIMIT_CPU` as a backstop;
- a wall-clock watchdog in the zygote: a child still running after `Limits.seconds` is killed with
  its whole process group and reported as `timed_out` (a hang: a FIFO opened for reading, a read of
  /dev/zero, a pickle bomb);
- its peak resident memory from `wait4`, reported as growth over the zygote's own.

A child exits the way the interpreter would: `SystemExit` gives its code, an uncaught exception
prints its traceback and exits 1, non-daemon threads are joined and `atexit` handlers run.
`hooks` install fault wrappers in the child before the command runs (see `HOOKS`): faults injected
by wrapping what the command calls, never by patching ckptflow.

`Harness` keeps `workers` zygotes (each serves one child at a time) and restarts one that died.
`spawn=True` runs a command as a plain `python -m ckptflow.cli` subprocess with the same limits
instead: the fidelity check, and the fallback for anything a fork cannot model.

Run `python -m tests.hostile.harness --serve` to start a zygote by hand (it speaks JSON lines).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What the zygote imports before it forks: everything the commands under test load on their way.
PRELOAD = (
    "ckptflow.cli",
    "ckptflow.validate",
    "ckptflow.consolidate",
    "ckptflow.reshard",
    "ckptflow.publish",
    "ckptflow.publish.hub",
    "numpy",
    "torch",
    "huggingface_hub",
    "huggingface_hub.hf_api",
    "fsspec.implementations.local",
    "fsspec.implementations.memory",
)

# The environment every zygote starts with (on top of the caller's): no thread pools at import time
# (a fork must happen in a single-threaded process), few malloc arenas (they reserve address space
# that RLIMIT_AS counts), a wide terminal so that rich never wraps a line, the emulator settings.
ZYGOTE_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
    "COLUMNS": "1000",
    "LINES": "50",
    "TERM": "dumb",
    "NO_COLOR": "1",
    "PYTHONUNBUFFERED": "1",
    "DS_ACCELERATOR": "cpu",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "HF_HUB_DISABLE_XET": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


@dataclass(frozen=True)
class Limits:
    """Bounds on one command: wall seconds, address space over the zygote's, largest file written."""

    seconds: float = 10.0
    memory: int = 2 << 30
    file_size: int = 256 << 20
    # Resident-memory growth over the zygote past which a run counts as a memory blow-up.
    rss_growth: int = 768 << 20


@dataclass(frozen=True)
class Result:
    """What one command did."""

    argv: tuple[str, ...]
    returncode: int | None  # None when killed by a signal
    signal: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    rss_growth: int  # bytes of peak resident memory above the zygote's (spawned runs: the whole peak)
    spawned: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self) -> str:
        how = (
            f"killed after {self.seconds:.1f}s (time limit)" if self.timed_out
            else f"killed by {signal.Signals(self.signal).name}" if self.signal
            else f"exit {self.returncode}"
        )
        tail = lambda text: "\n".join(text.rstrip().splitlines()[-15:])  # noqa: E731
        return (
            f"$ ckptflow {' '.join(self.argv)}\n  {how}, {self.seconds:.2f}s, +{self.rss_growth >> 20} MiB resident\n"
            f"  stdout: {tail(self.stdout)[:3000]!s}\n  stderr: {tail(self.stderr)[:3000]!s}"
        )


# ---- fault wrappers a child can install before its command runs ----------------------------------------


def _hook_shrink_after_map(arg: str) -> None:
    """Truncate the local file `arg` to half its size right after it is first memory-mapped: a file
    changed under a reader by another process (a sync job, a user). Wraps `mmap.mmap`."""
    import mmap

    real = mmap.mmap
    done = []

    class Mapped(real):  # type: ignore[misc, valid-type]
        def __new__(cls, fileno: int, length: int, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            obj = real.__new__(cls, fileno, length, *args, **kwargs)
            if not done and fileno >= 0 and os.path.realpath(f"/proc/self/fd/{fileno}") == os.path.realpath(arg):
                done.append(True)
                os.truncate(arg, os.path.getsize(arg) // 2)
            return obj

    mmap.mmap = Mapped  # type: ignore[misc]


def _hook_shrink_after_read(arg: str) -> None:
    """Truncate the local file `arg` to half its size right after its first `os.preadv`: a file changed
    under a reader that reads instead of mapping. Wraps `os.preadv`."""
    real = os.preadv
    done = []

    def preadv(fd: int, buffers: object, offset: int, *args: object) -> int:
        n = real(fd, buffers, offset, *args)
        if not done and os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(arg):
            done.append(True)
            os.truncate(arg, os.path.getsize(arg) // 2)
        return n

    os.preadv = preadv  # type: ignore[assignment]


def _hook_hang(arg: str) -> None:
    """Block before the command runs: a hang the harness must kill at its time limit."""
    threading.Event().wait()


def _hook_fill(arg: str) -> None:
    """Write zeros to the file `arg` until the file-size limit stops it, the error on stderr; then the
    command runs."""
    try:
        with open(arg, "wb") as fh:
            while True:
                fh.write(bytes(1 << 20))
    except OSError as exc:
        print(f"fill {arg}: {exc}", file=sys.stderr)


def _hook_allocate(arg: str) -> None:
    """Allocate `arg` bytes, the MemoryError on stderr when the memory limit refuses them; then the
    command runs."""
    try:
        bytearray(int(arg))
    except MemoryError:
        print(f"allocate {arg}: MemoryError", file=sys.stderr)


HOOKS = {"shrink-after-map": _hook_shrink_after_map, "shrink-after-read": _hook_shrink_after_read,
         "hang": _hook_hang, "fill": _hook_fill, "allocate": _hook_allocate}


# ---- the zygote ---------------------------------------------------------------------------------------


def _vm(field_name: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(req: Mapping[str, object], protocol_fds: Sequence[int]) -> None:
    """Runs in the forked child; never returns."""
    import resource
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)
        for fd in protocol_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            target = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(str(req["cwd"]))
        os.environ.update({str(k): str(v) for k, v in dict(req.get("env") or {}).items()})  # type: ignore[call-overload]
        for key in req.get("unset") or ():  # type: ignore[attr-defined]
            os.environ.pop(str(key), None)
        import fsspec.config

        fsspec.config.set_conf_env(fsspec.config.conf)  # FSSPEC_* variables of this run
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        address_space = _vm("VmSize") + int(req["memory"])  # type: ignore[call-overload]
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        cpu = int(float(req["seconds"]) * 3) + 5  # type: ignore[arg-type]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(req["file_size"]), int(req["file_size"])))  # type: ignore[call-overload]
        for name, arg in req.get("hooks") or ():  # type: ignore[attr-defined]
            HOOKS[name](arg)
        sys.argv = ["ckptflow", *req["argv"]]  # type: ignore[misc]
        try:
            from ckptflow.cli import main

            main()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        try:  # the interpreter's own shutdown: join non-daemon threads, then atexit
            threading._shutdown()  # type: ignore[attr-defined]
        except BaseException:
            traceback.print_exc()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


def _wait(pid: int, seconds: float) -> tuple[int, object, bool, float]:
    """(status, rusage, timed_out, elapsed) of child `pid`, killing its process group past `seconds`."""
    started = time.monotonic()
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], seconds)
    finally:
        os.close(pidfd)
    timed_out = not ready
    if timed_out:
        _kill_group(pid)
    _, status, rusage = os.wait4(pid, 0)
    elapsed = time.monotonic() - started
    _kill_group(pid)  # anything the command left running
    return status, rusage, timed_out, elapsed


def _kill_group(pid: int) -> None:
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def serve() -> None:
    """The zygote: import everything once, then fork one child per JSON request read from stdin."""
    import importlib

    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit(f"zygote has {len(os.listdir('/proc/self/task'))} threads after its imports; cannot fork "
                         "safely")
    baseline = _vm("VmRSS")
    replies.write(json.dumps({"ready": True, "rss": baseline, "vm": _vm("VmSize")}) + "\n")
    replies.flush()
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, (requests.fileno(), replies.fileno()))
        try:
            os.setpgid(pid, pid)
        except (ProcessLookupError, PermissionError):
            pass
        status, rusage, timed_out, elapsed = _wait(pid, float(req["seconds"]))
        reply = {
            "returncode": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "seconds": elapsed,
            "timed_out": timed_out,
            "rss_growth": max(0, rusage.ru_maxrss * 1024 - baseline),  # type: ignore[attr-defined]
        }
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# ---- the client side ----------------------------------------------------------------------------------


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment commands run in: the caller's, the worktree first on the path, ZYGOTE_ENV."""
    env = {**os.environ, **ZYGOTE_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
                                                      and p != str(REPO)]])
    for key in ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "COV_CORE_SOURCE"):
        env.pop(key, None)
    return env


class Zygote:
    """One zygote process and the requests it serves, one at a time."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="ckptflow-zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile.harness", "--serve"], cwd=REPO, env=dict(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the zygote did not start: {Path(self.log.name).read_text()[-3000:]}")
        ready = json.loads(line)
        self.rss = int(ready["rss"])

    def run(self, request: Mapping[str, object]) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died: {Path(self.log.name).read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


@dataclass
class Harness:
    """`workers` zygotes serving `run` calls from any thread."""

    workers: int = 2
    env: Mapping[str, str] = field(default_factory=base_env)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        self._idle: queue.Queue[Zygote | None] = queue.Queue()
        for _ in range(self.workers):
            self._idle.put(None)  # started on first use
        self._all: list[Zygote] = []
        self._lock = threading.Lock()

    def run(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None, unset: Sequence[str] = (),
            hooks: Sequence[tuple[str, str]] = (), limits: Limits | None = None, spawn: bool = False) -> Result:
        limits = limits or self.limits
        if spawn:
            return spawn_run(argv, cwd=cwd, env={**self.env, **(env or {})}, unset=unset, limits=limits)
        with tempfile.TemporaryDirectory(prefix="ckptflow-run-") as tmp:
            request = {
                "argv": list(argv), "cwd": str(cwd), "env": dict(env or {}), "unset": list(unset),
                "hooks": [list(h) for h in hooks], "stdout": f"{tmp}/stdout", "stderr": f"{tmp}/stderr",
                "seconds": limits.seconds, "memory": limits.memory, "file_size": limits.file_size,
            }
            with self._zygote() as zygote:
                reply = zygote.run(request)
            return Result(
                argv=tuple(argv), returncode=reply["returncode"], signal=reply["signal"],  # type: ignore[arg-type]
                stdout=_read_text(f"{tmp}/stdout"), stderr=_read_text(f"{tmp}/stderr"),
                seconds=float(reply["seconds"]), timed_out=bool(reply["timed_out"]),  # type: ignore[arg-type]
                rss_growth=int(reply["rss_growth"]),  # type: ignore[call-overload]
            )

    @contextmanager
    def _zygote(self) -> Iterator[Zygote]:
        zygote = self._idle.get()
        try:
            if zygote is None:
                zygote = Zygote(self.env)
                with self._lock:
                    self._all.append(zygote)
            yield zygote
        except RuntimeError:  # a dead zygote: the next caller starts a fresh one
            if zygote is not None:
                zygote.close()
            zygote = None
            raise
        finally:
            self._idle.put(zygote)

    def close(self) -> None:
        with self._lock:
            for zygote in self._all:
                zygote.close()
            self._all.clear()


def _read_text(path: str) -> str:
    with open(path, "rb") as fh:
        data = fh.read(4 << 20)  # a 10 MB error line is a finding; keep enough to show it
    return data.decode("utf-8", errors="replace")


def spawn_run(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], unset: Sequence[str] = (),
              limits: Limits = Limits()) -> Result:
    """`python -m ckptflow.cli ARGV` as a fresh process with the same limits (address space counted
    from zero: a fresh interpreter maps about 1 GB importing torch)."""
    import resource

    env = {k: v for k, v in env.items() if k not in unset}

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory + (3 << 30),) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size,) * 2)

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "ckptflow.cli", *argv], cwd=cwd, env=dict(env), stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL, preexec_fn=limit, start_new_session=True)
        status, rusage, timed_out, _ = _wait(proc.pid, limits.seconds + 5)  # + the interpreter's start
        proc.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        return Result(
            argv=tuple(argv), returncode=proc.returncode if os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            stdout=out.read(4 << 20).decode("utf-8", "replace"), stderr=err.read(4 << 20).decode("utf-8", "replace"),
            seconds=elapsed, timed_out=timed_out, rss_growth=rusage.ru_maxrss * 1024, spawned=True,  # type: ignore[attr-defined]
        )


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        raise SystemExit("usage: python -m tests.hostile.harness --serve  (a zygote speaking JSON lines)")
    serve()
