"""A warm interpreter that starts the tests' `python -m speedtronic` commands by forking.

A `python -m speedtronic` process spends about 2.5 CPU-seconds importing torch and the package
before the command's first line runs, and the suite starts a few hundred of them. This server
imports both once, then forks one child per command. The child is a process of its own, with its own
pid, signals, exit status, standard streams, working folder and environment. It runs
`python -m speedtronic` as the command line does, without importing anything again.

A command comes here only when a fresh interpreter would start it the same way: the same
executable, and no setting read at interpreter or torch start-up that differs from the server's
(`STARTUP_ENV`). A command that does not qualify is refused, and the caller starts it the ordinary
way (`conftest.run_cli` and `conftest.start_cli` do both).

torchrun jobs come here too: their launcher (`python -m torch.distributed.run`, which imports torch
as well) is forked like a command, and each rank it starts is `tests/forkrank.py`, a small process
that asks this server for the rank's `python -m speedtronic` and stands in for it towards torchrun:
it passes every signal on and ends as the rank ends.

Protocol, one `SOCK_SEQPACKET` connection per command: the client sends a JSON request (`args`,
`cwd`, `env`, `new_session`, and optionally `module`, one of `MODULES`, or `script`, a file to run
as `python SCRIPT ARGS` (torchrun's ranks that are scripts), `hangup_kills`, `bill_to`: the pid
of a child of this server whose CPU seconds this child's are added to, a rank's launcher, and
`niceness`, the priority to run at) with
its stdin, stdout and stderr descriptors attached. The server answers `pid N` or `refused WHY`.
When the child ends, it answers `exit STATUS CPU` (a raw wait status, and the CPU seconds of the
child and its children) and closes the connection. With `hangup_kills`, a client that closes its
end first (a rank's stand-in killed with SIGKILL) takes the child with it: SIGKILL.

    python tests/forkserver.py SOCKET  # prints "ready" once it listens; ends when stdin closes
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys

import torch

# settings a fresh interpreter, torch or the C libraries below it read when they start: a command
# whose environment differs from the server's in one of them must start afresh
STARTUP_ENV = (
    "PYTHON",
    "LD_",
    "OMP_",
    "MKL_",
    "KMP_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "LC_",
    "LANG",
    "TMPDIR",  # torch's inductor derives its cache folder from it when torch._dynamo is imported
)
# read by the child itself, after the fork, as a fresh interpreter would read them
CHILD_READS = (
    "PYTHONPATH",
    "PYTHONFAULTHANDLER",
    "PYTHONUNBUFFERED",
    "PYTHONIOENCODING",
    "OMP_NUM_THREADS",
)
# ... and what torchrun sets for its ranks, read when a rank sets up its process group
RUN_READS = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# the modules a request may run as `python -m MODULE`
MODULES = ("speedtronic", "torch.distributed.run")
MAX_REQUEST = 1 << 20
DEFAULT_THREADS = 1
# what `warm`'s imports set in the environment (torch._dynamo: TORCHINDUCTOR_CACHE_DIR), taken out
# of the server's own and set in each child, where a fresh interpreter's imports would set it
WARM_SETS: dict[str, str] = {}


def startup_differences(env: dict, server_env: dict) -> list[str]:
    "The start-up settings on which `env` and the server's environment disagree."
    keys = {
        k
        for k in {*env, *server_env}
        if k.startswith(STARTUP_ENV) and k not in CHILD_READS and not k.startswith(RUN_READS)
    }
    return sorted(k for k in keys if env.get(k) != server_env.get(k))


def loaded_modules() -> dict[str, str]:
    "Each top-level module imported here, with the file or package folder it came from."
    found = {}
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if "." in name or name == "__main__" or not origin:
            continue
        found[name] = os.path.realpath(
            os.path.dirname(origin) if origin.endswith("__init__.py") else origin
        )
    return found


def shadowing(paths: list[str], loaded: dict[str, str]) -> list[str]:
    """What a folder in `paths` holds that a fresh interpreter would import instead of a module
    already imported here from elsewhere."""
    found = []
    for folder in paths:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.realpath(os.path.join(folder, name))
            top = name.removesuffix(".py")
            module = name.endswith(".py") or os.path.isdir(path)
            if module and top in loaded and loaded[top] != path:
                found.append(path)
    return found


def refusal(request: dict) -> str | None:
    "Why `request` must start in a fresh interpreter, or None when a fork runs it the same way."
    env = request["env"]
    if request.get("module", "speedtronic") not in MODULES:
        return f"runs module {request.get('module')!r}, not one of {', '.join(MODULES)}"
    # a setting the warm-up set itself, asked for with the value it set, is the fresh start's too
    # (the test process set it the same way once it stepped an optimizer of its own)
    differ = [
        key
        for key in startup_differences(env, dict(os.environ))
        if key not in WARM_SETS or env.get(key) != WARM_SETS[key]
    ]
    if differ:
        return f"start-up settings differ: {', '.join(differ)}"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.path.dirname(os.path.abspath(request["script"])) if "script" in request else None
    shadowed = shadowing([first or request["cwd"], *paths], loaded_modules())
    if shadowed:
        return f"would shadow imported modules: {', '.join(shadowed)}"
    return None


def _std_stream(fd: int, name: str):
    "A standard stream over `fd` as a fresh interpreter makes it (line-buffered on a terminal)."
    import io

    encoding, _, errors = os.environ.get("PYTHONIOENCODING", "").partition(":")
    old = getattr(sys, f"__{name}__")
    encoding = encoding or getattr(old, "encoding", None) or "utf-8"
    if name == "stdin":
        raw = io.FileIO(fd, "r", closefd=False)
        return io.TextIOWrapper(io.BufferedReader(raw), encoding, errors or old.errors)
    raw = io.FileIO(fd, "w", closefd=False)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    stream = io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding,
        errors or ("backslashreplace" if name == "stderr" else old.errors),
        line_buffering=name == "stderr" or raw.isatty(),
        write_through=unbuffered,
    )
    return stream


def become_child(request: dict, fds: list[int], base_path: list[str]) -> None:
    "Turn this freshly forked process into `python -m MODULE ARGS` as `request` describes."
    if request.get("new_session"):
        os.setsid()
    if isinstance(request.get("niceness"), int):  # the requester's priority (only lowered)
        os.nice(max(0, request["niceness"] - os.nice(0)))
    for handled in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(handled, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in WARM_SETS.items():  # as the imports of a fresh interpreter set them
        os.environ.setdefault(key, value)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # a script's folder comes first on the path, as in a fresh `python SCRIPT`; else the folder
    script = os.path.abspath(request["script"]) if "script" in request else None
    first = os.path.dirname(script) if script else request["cwd"]
    sys.path[:] = [first, *extra, *(p for p in base_path if p not in extra)]
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        stream = _std_stream(fd, name)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import faulthandler

    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(sys.stderr)
    else:
        faulthandler.disable()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(
        int(threads) if threads.isdigit() and int(threads) > 0 else DEFAULT_THREADS
    )
    sys.argv = [script, *request["args"]] if script else ["-m", *request["args"]]


def serve(path: str) -> tuple[dict, list[int], list[str]]:
    """Listen on `path` and fork a child per request. Returns only in a child, with its request,
    descriptors and the server's module path; the server itself ends when its stdin closes."""
    base_path = [p for p in sys.path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # a Ctrl-C a test sends to its process group is for the commands, not for the server
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that started it
    watched: dict[socket.socket, int] = {}  # a `hangup_kills` connection -> its child's pid
    # a rank's CPU is billed to its torchrun launcher, when that is a child here too (`bill_to`)
    payer: dict[int, int] = {}  # child pid -> the child pid its CPU is added to
    billed: dict[int, float] = {}  # child pid -> the CPU seconds of others added to its own
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    os._exit(0)
            elif key.data == "reap":
                wake_read.recv(4096)
                while waiting:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn in watched:
                        selector.unregister(conn)
                        del watched[conn]
                    if conn is not None:
                        # the child's, its children's, and what is billed to it
                        cpu = usage.ru_utime + usage.ru_stime + billed.pop(pid, 0.0)
                        if pid in payer and payer[pid] in waiting:
                            billed[payer[pid]] = billed.get(payer[pid], 0.0) + cpu
                            cpu = 0.0
                        payer.pop(pid, None)
                        try:
                            conn.send(f"exit {status} {cpu:.3f}".encode())
                        except OSError:
                            pass
                        conn.close()
            elif key.data == "hangup":  # a `hangup_kills` client ended before its child
                conn = key.fileobj
                selector.unregister(conn)
                pid = watched.pop(conn)
                if waiting.get(pid) is conn:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            else:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
                request = json.loads(message)
                why = refusal(request) if len(fds) == 3 else "stdin, stdout and stderr not sent"
                if why is not None:
                    conn.send(f"refused {why}".encode())
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for other in (listener, wake_read, wake_write, conn, *waiting.values()):
                        other.close()
                    return request, fds, base_path
                for fd in fds:
                    os.close(fd)
                conn.send(f"pid {pid}".encode())
                waiting[pid] = conn
                if request.get("bill_to") in waiting:
                    payer[pid] = request["bill_to"]
                if request.get("hangup_kills"):
                    watched[conn] = pid
                    selector.register(conn, selectors.EVENT_READ, "hangup")


def warm() -> None:
    """Import what a `python -m speedtronic` command imports before its first line (and at its first
    optimizer step), and note the thread count a fresh interpreter without OMP_NUM_THREADS would
    use."""
    global DEFAULT_THREADS
    DEFAULT_THREADS = torch.get_num_threads()
    started = dict(os.environ)

    import speedtronic.cli  # noqa: F401
    import speedtronic.distributed  # noqa: F401
    import speedtronic.runtime  # noqa: F401

    # torch.optim's step imports torch._dynamo the first time an optimizer steps (about 1 CPU-second
    # of every training command); it starts no thread, so a child forked after it is still whole
    import torch._dynamo as _dynamo  # noqa: F401 (binds no local `torch`)

    WARM_SETS.update({k: v for k, v in os.environ.items() if started.get(k) != v})
    for key in WARM_SETS:  # requests are compared with the environment the server started with
        if key in started:
            os.environ[key] = started[key]
        else:
            del os.environ[key]


def exit_status(stop: SystemExit) -> int:
    "The exit status a fresh interpreter gives `stop` (a message goes to stderr, status 1)."
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def run_as_main(module: str = "speedtronic", script: str | None = None) -> None:
    """Run `python -m MODULE` (or `python SCRIPT`) in this child, then end it as a fresh
    interpreter ends: wait for its threads, run the `atexit` callbacks, flush the standard streams,
    exit with its status (or die of SIGINT after an unhandled KeyboardInterrupt). Tearing down the
    imported modules is left out: it costs 1.8 s with torch loaded, and no one outside the process
    can tell."""
    import atexit
    import runpy
    import threading

    status, interrupted = 0, False
    try:
        if script is not None:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        status = exit_status(stop)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


if __name__ == "__main__":
    warm()
    request, fds, base_path = serve(sys.argv[1])
    become_child(request, fds, base_path)
    module, script = request.get("module", "speedtronic"), request.get("script")
    del request, fds, base_path
    run_as_main(module, None if script is None else os.path.abspath(script))
