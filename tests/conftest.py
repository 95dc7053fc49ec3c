import atexit, contextlib, json, os, select, shutil, signal, socket, subprocess, sys
import textwrap, threading, time
from pathlib import Path
from typing import Any, Sequence

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

# The tests live in one folder per area of the package (tests/core, tests/train, tests/diloco, ...),
# the same areas as the chapters. Helpers shared by every area are here and in hub_server.py (the
# loopback Hub stand-in); a test module may also import another area's module (`from test_parallel
# import ...`), so every area folder is importable by name, as the flat tests/ folder was.
TESTS = Path(__file__).resolve().parent
AREAS = sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
sys.path[:0] = [str(p) for p in [TESTS, *AREAS] if str(p) not in sys.path]

# One thread of PyTorch per process (tools/test_all.sh exports it too, for nbdev_test and the
# kernels the browser tests start). Three pytest workers on two cores, each with PyTorch's default
# two threads, spend most of their CPU spinning: two such processes training at once used 3.3 times
# the CPU of two single-threaded ones, three used 6 to 7 times (the same loop, measured here).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a plugin imported it before this file: its thread pool is sized
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def v2_fixtures_dir() -> tuple[Path | None, str]:
    """The files 2.0.0 wrote (`shared/fixtures/v2.0`) and, when they are missing, why: the folder
    `$SPEEDTRONIC_FIXTURES` names when set, else `shared/fixtures/v2.0` beside the clone (CI), else
    `/work/shared/fixtures/v2.0`. Every test that reads them looks here, so one variable serves
    all."""
    if os.environ.get("SPEEDTRONIC_FIXTURES"):
        named = Path(os.environ["SPEEDTRONIC_FIXTURES"])
        if named.is_dir():
            return named, ""
        return None, f"the 2.0 fixtures are missing: SPEEDTRONIC_FIXTURES={named} is not a folder"
    candidates = [ROOT.parent / "shared" / "fixtures" / "v2.0", Path("/work/shared/fixtures/v2.0")]
    found = next((c for c in candidates if c.is_dir()), None)
    if found:
        return found, ""
    return None, (
        f"the 2.0 fixtures are missing (looked in {', '.join(map(str, candidates))}): put shared/ "
        "beside the clone or set SPEEDTRONIC_FIXTURES to shared/fixtures/v2.0"
    )


V2_FIXTURES, V2_FIXTURES_MISSING = v2_fixtures_dir()
# a marker for a test that reads the 2.0 fixtures: skipped, with the reason and the fix, without
# them
needs_v2_fixtures = pytest.mark.skipif(V2_FIXTURES is None, reason=V2_FIXTURES_MISSING)


@pytest.fixture(scope="session")
def docs_site():
    """Build the docs site once per test run (tools/build_docs.py) and return its folder; under
    pytest-xdist the first worker to ask builds it while the others wait, and all read that one
    build."""
    import fcntl

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"{os.getpid()}")
    built = ROOT / "docs" / ".built-for-test-run"
    with open(ROOT / "_proc.build-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if not (built.exists() and built.read_text() == run):
            res = subprocess.run(
                [sys.executable, "tools/build_docs.py"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            built.write_text(run)
    return ROOT / "docs"


def tiny_config(
    tmp: Path,
    name: str = "cfg.yaml",
    *,
    max_steps: int = 4,
    every_steps: int = 2,
    keep_last: int | None = 2,
    metrics: bool = True,
    **sections,
) -> Path:
    """A one-layer CPU run on 64 synthetic tokens, written to `tmp/name`; each of `sections` is
    merged over its default section."""
    raw = {
        "run": {"name": "tiny", "seed": 3, "max_steps": max_steps, "output_dir": str(tmp / "out")},
        "model": {
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
            "d_ff": 64,
        },
        "data": {"num_tokens": 64, "block_size": 16, "micro_batch_size": 2, "target_batch_size": 2},
        "precision": "fp32",
        "checkpoint": {"every_steps": every_steps, "keep_last": keep_last},
        "logging": {
            "progress": False,
            "loss_plot": False,
            **({"json_file": str(tmp / "metrics.jsonl")} if metrics else {}),
        },
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# The tests press Ctrl-C in their children: a suite started in the background, where the shell
# ignores SIGINT, must not hand that on (a child that inherits SIG_IGN never raises
# KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def cli_env(*, faulthandler: bool = True, **extra: str) -> dict:
    """The environment of a `speedtronic` subprocess: this checkout importable, one thread, stacks
    printed on a fatal signal (PYTHONFAULTHANDLER, unless `faulthandler` is false: then it is this
    process's), and `extra`."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        **({"PYTHONFAULTHANDLER": "1"} if faulthandler else {}),
        **extra,
    }


HUB_TOKEN = "hf_test_write_token_0123456789"


@pytest.fixture
def cpu_to_itself(tmp_path_factory):
    """Hold the test run's lock of paced tests while the test runs: a test whose outcome depends on
    the nodes keeping pace (a simulation at 60x) never runs beside another that holds it. Under
    pytest-xdist the other worker runs any other test meanwhile (a test that must have the CPU
    alone is marked `cpu_alone`); its workers' temporary folders share a parent, where the lock file
    is."""
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "cpu-to-itself.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        yield


@contextlib.contextmanager
def cpu_share(exclusive: bool):
    """Under pytest-xdist, the run's CPU lock for one test: shared by every test, or held alone by
    one marked `cpu_alone` (nothing else runs meanwhile, not even the other worker's fixtures). A
    turnstile lock taken first keeps a waiting `cpu_alone` test from being overtaken forever."""
    import fcntl
    import tempfile

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside this test anyway
        yield
        return
    folder = Path(tempfile.gettempdir())
    with (
        open(folder / f"speedtronic-tests-{run}.turnstile", "w") as turnstile,
        open(folder / f"speedtronic-tests-{run}.cpu", "w") as cpu,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(cpu, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)  # the next test may come in
        yield  # both are released when the files close, or the worker dies


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test's setup, call and teardown hold the run's CPU lock (`cpu_share`), and leave
    this process's environment as they found it; with SPEEDTRONIC_TEST_CPU_LOG=FILE each test
    then writes what it cost (`_cpu_spent`)."""
    log = os.environ.get("SPEEDTRONIC_TEST_CPU_LOG")
    # What the code a test runs in this process sets in the environment (training seeds it, and
    # the seeding sets PYTHONHASHSEED for child processes) would otherwise reach every later test
    # of this worker, and a command whose start-up settings differ from the fork server's starts
    # in a fresh interpreter.
    environment = dict(os.environ)
    with cpu_share(item.get_closest_marker("cpu_alone") is not None):
        before = _cpu_spent() if log else None
        yield
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        for key, value in environment.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if log:
            after = _cpu_spent()
            spent = {k: round(after[k] - before[k], 3) for k in before}
            with open(log, "a") as f:
                f.write(json.dumps({"test": item.nodeid, **spent}) + "\n")


# CPU seconds of the commands this test process's fork server forked, as it reaped them
_FORKED_CPU = [0.0]


def _cpu_spent() -> dict[str, float]:
    """Wall and CPU seconds so far: this test process's own CPU, its reaped subprocesses' (fresh
    interpreters, torchrun, bench scripts) and its forked commands' (the fork server's `wait4`)."""
    import resource

    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return {
        "wall": time.monotonic(),
        "own": own.ru_utime + own.ru_stime,
        "subprocesses": children.ru_utime + children.ru_stime,
        "forked": _FORKED_CPU[0],
    }


@pytest.fixture
def hub_tokens() -> dict[str, str]:
    """The tokens the `hub` fixture accepts (token -> "read" | "write"); a test module overrides
    this fixture to give its own."""
    return {HUB_TOKEN: "write"}


# The files that take longest (wall seconds on three workers, measured from a fresh clone), longest
# first. pytest-xdist hands out whole files in collection order (`--dist loadfile`, with
# `--no-loadscope-reorder`: by default it sends the files with the most tests first), and a run ends
# when its last file does: these go out first, the rest fill in behind them (longest processing
# time first). The simulations lead: paced, one at a time, they are 5 minutes of one worker.
SLOWEST_FILES = (
    "diloco/test_sim.py",
    "app/test_samples.py",
    "house/test_bench.py",
    "diloco/test_diloco.py",
    "house/test_docs.py",
    "app/test_browser.py",
    "diloco/test_per_node_layout.py",
    "interop/test_hf.py",
    "interop/test_hf_datasets.py",
)


def pytest_collection_modifyitems(config, items):
    "The files of `SLOWEST_FILES` first, in that order; every other file after, as collected."
    if missing := [name for name in SLOWEST_FILES if not (TESTS / name).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py: SLOWEST_FILES names no such file: {missing}")
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}

    def place(item) -> int:
        path = Path(str(item.path)).resolve()
        name = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""
        return rank.get(name, len(rank))

    items.sort(key=place)  # stable: a file's tests stay together and in order


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "hub_limits(**limits): the `hub` fixture's stand-in with these of HUB_LIMITS replaced "
        "(say why beside it)",
    )
    config.addinivalue_line(
        "markers",
        "cpu_alone: under pytest-xdist nothing else runs while this test runs (an outcome that "
        "depends on processes keeping pace with each other; say why beside it)",
    )


@pytest.fixture
def hub(request, hub_tokens):
    """A loopback Hub stand-in (tests/hub_server.py) accepting `hub_tokens`, with the Hub's limits
    (`HUB_LIMITS`; a test's `@pytest.mark.hub_limits(name=value)` replaces one by name), stopped
    after the test."""
    from hub_server import HUB_LIMITS, HubStandIn

    marker = request.node.get_closest_marker("hub_limits")
    changed = marker.kwargs if marker else {}
    unknown = set(changed) - set(HUB_LIMITS)
    assert not unknown, f"hub_limits names no limit {sorted(unknown)}"
    with HubStandIn(**{**HUB_LIMITS, **changed}, tokens=hub_tokens) as server:
        yield server


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first, then theirs), from /proc; empty where /proc is
    missing."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                kids = []
            found += kids
            todo += kids
    return found


def communicate_or_dump(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`proc.communicate(timeout)`; past the timeout every Python process below it prints its
    threads' stacks (PYTHONFAULTHANDLER is set by `cli_env`: SIGABRT makes faulthandler write them)
    and the test fails showing them."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid) + [proc.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(
            f"{proc.args} still ran after {timeout:g} s; its processes' "
            f"stacks:\n{(err or '')[-12000:]}\n"
            f"last output:\n{(out or '')[-3000:]}",
            pytrace=False,
        )


class ForkedPopen(subprocess.Popen):
    """A `subprocess.Popen` of `python -m speedtronic ...` whose child the warm interpreter of
    `tests/forkserver.py` forks, skipping the 2.5 CPU-seconds of imports a fresh one spends. Pipes,
    `communicate`, timeouts, signals and exit codes behave as for any `Popen`. A command the server
    refuses (one that needs a fresh interpreter) is started the ordinary way."""

    def __init__(self, server: Path, command: dict, *args, **kwargs):
        "`command`: the request's `module` (or `script`) and `args` (`forked_command`)."
        self._server, self._command = server, command
        self._ended, self._exit_lock = None, threading.Lock()
        super().__init__(*args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = rest[3:9]
        start_new_session, process_group = rest[-2:]
        request = {
            **self._command,
            "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
            "env": {str(k): str(v) for k, v in (os.environ if env is None else env).items()},
            "new_session": bool(start_new_session) or process_group == 0,
        }
        fds = [p2cread, c2pwrite, errwrite]
        fds = [fd if fd != -1 else std for fd, std in zip(fds, (0, 1, 2))]
        forkable = preexec_fn is None and not pass_fds and executable is None
        self._ended = self._ask_server(request, fds) if forkable else None
        if not forkable:
            self._said = "refused: preexec_fn, pass_fds or executable given"
        _note_command(request["args"], self._said)
        if self._ended is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest
            )
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._closed_child_pipe_fds = True

    def _ask_server(self, request: dict, fds: list[int]) -> socket.socket | None:
        """Send `request` with the child's standard descriptors. Returns the connection its exit
        status will come on (`self.pid` set), or None: refused, or the server is unreachable."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(str(self._server))
            socket.send_fds(connection, [json.dumps(request).encode()], fds)
            answer = connection.recv(4096).decode()
        except OSError:
            answer = ""
        self._said = "forked" if answer.startswith("pid ") else answer or "server unreachable"
        if not answer.startswith("pid "):
            connection.close()
            return None
        self.pid = int(answer.split()[1])
        return connection

    def _read_exit(self, timeout: float | None) -> bool:
        "Take the child's exit status from the server once it is sent, within `timeout`."
        with self._exit_lock:
            if self.returncode is not None:
                return True
            if not select.select([self._ended], [], [], timeout)[0]:
                return False
            answer = self._ended.recv(4096).decode()
            self._ended.close()
            if not answer.startswith("exit "):
                raise RuntimeError(f"the fork server lost child {self.pid}: {answer!r}")
            _, status, *cpu = answer.split()
            _FORKED_CPU[0] += float(cpu[0]) if cpu else 0.0
            self._handle_exitstatus(int(status))
            return True

    def _internal_poll(self, _deadstate=None, **_):
        if self._ended is None:
            return super()._internal_poll(_deadstate=_deadstate)
        self._read_exit(0)
        return self.returncode

    def _wait(self, timeout):
        if self._ended is None:
            return super()._wait(timeout)
        if not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


_FORK_SERVER: dict[str, Any] = {}


def _note_command(args: list[str], outcome: str) -> None:
    """With SPEEDTRONIC_TEST_FORK_LOG=FILE, a line of JSON per `python -m speedtronic` command a
    test starts: the test, the command, and whether the warm interpreter forked it (else why not):
    how much of the suite the fork server serves."""
    log = os.environ.get("SPEEDTRONIC_TEST_FORK_LOG")
    if log:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "args": args[:2]}
        with open(log, "a") as f:
            f.write(json.dumps({**line, "outcome": outcome}) + "\n")


def fork_server() -> Path | None:
    """This test process's warm interpreter (`tests/forkserver.py`), started on first use; None
    when `SPEEDTRONIC_TEST_FORK=0` or it could not start (commands then start the ordinary way)."""
    if os.environ.get("SPEEDTRONIC_TEST_FORK", "1") == "0":
        return None
    if _FORK_SERVER.get("path") and _FORK_SERVER["server"].poll() is not None:
        _FORK_SERVER.clear()  # a working server ended (a test killed it): start another
    if "path" not in _FORK_SERVER:
        import tempfile

        path = Path(tempfile.gettempdir()) / f"speedtronic-fork-{os.getpid()}.sock"
        path.unlink(missing_ok=True)
        server = subprocess.Popen(
            [sys.executable, str(TESTS / "forkserver.py"), str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # the thread count is the child's to set (OMP_NUM_THREADS, read after the fork)
            env={k: v for k, v in cli_env().items() if k != "OMP_NUM_THREADS"},
            cwd=ROOT,
        )
        ready = select.select([server.stdout], [], [], 120)[0] and server.stdout.readline()
        _FORK_SERVER.update(server=server, path=path if ready == b"ready\n" else None)
        atexit.register(server.stdin.close)
        atexit.register(path.unlink, missing_ok=True)
    return _FORK_SERVER["path"]


# the commands the warm interpreter may fork: `python -m MODULE ...`, and `python bench/SCRIPT ...`
FORKED_MODULES = ("speedtronic", "torch.distributed.run")


def forked_command(argv: list[str], cwd: str | os.PathLike | None = None) -> dict | None:
    """What the fork server is asked to run for `argv` (its `module` or `script`, and `args`), or
    None: a command it does not start."""
    if argv[:1] != [sys.executable] or len(argv) < 2:
        return None
    if argv[1] == "-m" and argv[2:3] and argv[2] in FORKED_MODULES:
        return {"module": argv[2], "args": argv[3:]}
    script = Path(cwd if cwd is not None else os.getcwd()) / argv[1]
    if script.suffix == ".py" and script.resolve().parent == ROOT / "bench" and script.is_file():
        return {"script": str(script.resolve()), "args": argv[2:]}
    return None


def spawn(argv: list, **popen) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen)`, except that a `python -m speedtronic ...` command (or a
    torchrun launcher, `python -m torch.distributed.run ...`, or a `python bench/SCRIPT.py ...`) is
    forked by this test process's warm interpreter (`fork_server`) where that starts it the same
    way."""
    argv = [os.fspath(a) for a in argv]
    command = forked_command(argv, popen.get("cwd"))
    server = fork_server() if command else None
    if server is None:
        if command:
            why = "fresh: no fork server (SPEEDTRONIC_TEST_FORK=0, or it failed)"
            _note_command(command["args"], why)
        return subprocess.Popen(argv, **popen)
    return ForkedPopen(server, command, argv, **popen)


def run_command(
    argv: list,
    *,
    input: str | bytes | None = None,
    timeout: float | None = None,
    capture_output: bool = False,
    check: bool = False,
    **popen,
) -> subprocess.CompletedProcess:
    "`subprocess.run` over `spawn`: the command to its end, its output captured when asked."
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    with spawn(argv, **popen) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def run_cli(
    *args: str, cwd: Path, env: dict | None = None, timeout: float = 300, **popen
) -> subprocess.CompletedProcess:
    """`python -m speedtronic *args` in `cwd`, to the end (`run_command`); `env` entries are added
    to `cli_env()`, `popen` goes to `subprocess.Popen`."""
    return run_command(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=cwd,
        env=cli_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def run_python(
    code: str,
    *args: str,
    env: dict | None = None,
    paths: list | None = None,
    cwd: Path = ROOT,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """`python -c code *args` in `cwd`, to the end, its output captured; `code` is dedented. `env`
    is the child's whole environment (None: this process's); with `paths` (a list, even empty) its
    PYTHONPATH becomes `paths` followed by this checkout."""
    if paths is not None:
        env = {
            **(os.environ if env is None else env),
            "PYTHONPATH": os.pathsep.join([*map(str, paths), str(ROOT)]),
        }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def start_cli(
    *args: str, cwd: Path = ROOT, env: dict | None = None, faulthandler: bool = True, **popen
) -> subprocess.Popen:
    """`python -m speedtronic *args` started in `cwd` (`spawn`), in text mode; `env` entries are
    added to `cli_env(faulthandler=faulthandler)`, `popen` (stdout, stderr, ...) goes to
    `subprocess.Popen`."""
    return spawn(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=cwd,
        env=cli_env(faulthandler=faulthandler, **(env or {})),
        text=True,
        **popen,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    "`proc`, which must have exited 0."
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The one `speedtronic: error:` line of a command that exited 2 without a traceback; it holds
    every one of `needles`."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("speedtronic: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def jsonl_records(path: Path, event: str | tuple[str, ...] = "train_step") -> list[dict]:
    """Every `event` record (of any of the names, given several) of a JSONL metrics file, in order;
    a line cut by a kill is skipped, a missing file is empty."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") in ((event,) if isinstance(event, str) else event):
            out.append(record)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stand_in_python() -> list[str]:
    """What stands for `python` where a process the test does not start itself (torchrun's ranks, a
    bench's nodes) starts `python -m speedtronic ...` or a script: `tests/forkrank.py` on this test
    process's warm interpreter (`fork_server`), or this interpreter where there is none."""
    server = fork_server()
    if server is None:
        return [sys.executable]
    return [sys.executable, "-S", str(TESTS / "forkrank.py"), str(server)]


def torchrun_command(*rank: str | Path, nproc: int = 2, options: Sequence[str] = ()) -> list[str]:
    """`python -m torch.distributed.run --nproc_per_node NPROC --master-port PORT OPTIONS RANK...`,
    where RANK is `-m speedtronic ARGS` or `SCRIPT ARGS`. With this test process's warm interpreter
    (`fork_server`), each rank is started by `tests/forkrank.py`, which has the server fork it and
    stands in for it towards torchrun (signals, exit), and `spawn` forks the launcher too."""
    rank = [os.fspath(r) for r in rank]
    python = stand_in_python()
    if python != [sys.executable]:  # the stand-in: torchrun runs it as the program itself
        rank = ["--no-python", *python, *rank]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master-port",
        str(free_port()),
        *options,
        *rank,
    ]


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser():
    """Headless Debian Chromium driven by Playwright; skipped when either is missing unless CI
    requires it."""
    exe = next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
            if shutil.which(n)
        ),
        None,
    )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if not exe or sync_playwright is None:
        if os.environ.get("SPEEDTRONIC_REQUIRE_BROWSER"):
            pytest.fail("Chromium or playwright is missing (see .ci/run)")
        pytest.skip("needs Debian chromium and the playwright package")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


def bpe_tokenizer_file(tmp: Path, text: str, vocab_size: int = 300) -> tuple[Any, Path]:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `text`, and the `tokenizer.json` it is
    saved to in `tmp`."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(
        [text],
        tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["[UNK]"],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp / "tokenizer.json"))
    return tok, tmp / "tokenizer.json"


def newton_schulz64(X, steps: int = 5, eps: float = 1e-7):
    """Newton–Schulz orthogonalisation as torch.optim.Muon's documentation writes it, in float64 (a
    reference, not our code)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def dotted_payload(index_bytes: bytes, command: str) -> bytes:
    """A `.metadata` that runs `command` through
    `torch.distributed.checkpoint.filesystem.os.system`, then holds the real index."""
    text = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()
    call = (
        text("torch.distributed.checkpoint.filesystem")
        + text("os.system")
        + b"\x93"
        + text(command)
        + b"\x85R0"
    )
    assert index_bytes[:2] == b"\x80\x04", "DCP wrote its index with pickle protocol 4"
    return b"\x80\x04" + call + index_bytes[2:]
