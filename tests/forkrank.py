"""A torchrun rank, forked by the test process's warm interpreter (`tests/forkserver.py`).

torchrun starts each rank as a process of its own and watches it: its pid, its signals, its exit.
A rank that is `python -m speedtronic train ...` spends about 3.5 CPU-seconds importing torch and
the package before its first step, and the suite starts a few hundred ranks. In the tests torchrun
starts this file instead (`--no-python`, with `python -S`: it imports almost nothing), which asks
the server listening on SOCKET to fork the rank's command (`-m speedtronic ARGS`, or a script) with
this process's environment, folder and standard streams, and then stands in for the rank towards
torchrun:

- every signal torchrun or a test sends it (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT) is
  passed on to the rank;
- killed itself (SIGKILL), it takes the rank with it (the server kills a child whose stand-in hangs
  up);
- it ends as the rank ends: the same exit code, or death by the same signal;
- the rank runs at its priority (niceness).

It stands in the same way for a bench's DiLoCo nodes (`SPEEDTRONIC_BENCH_PYTHON`).

A rank the server refuses, or any failure to reach it, becomes the ordinary command in this same
process (`exec`), so torchrun sees no difference.

    python -S tests/forkrank.py SOCKET -m speedtronic ARGS...
    python -S tests/forkrank.py SOCKET SCRIPT ARGS...
"""

import json
import os
import signal
import socket
import sys

PASSED_ON = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGQUIT,
)


def fresh(args: list[str], pending: list[int]) -> None:
    "Become `python -u -m speedtronic ARGS` in this process, as torchrun would have started it."
    for number in PASSED_ON:
        signal.signal(number, signal.SIG_DFL)
    if pending:  # a signal that came before the rank existed is for it: die of it, as it would
        os.kill(os.getpid(), pending[0])
    os.execv(sys.executable, [sys.executable, "-u", *args])


def end_as(status: int) -> None:
    "End this process as a child that ended with the raw wait `status` did."
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main(path: str, args: list[str]) -> None:
    if not args or (args[0] == "-m" and args[1:2] != ["speedtronic"]):
        raise SystemExit(f"usage: python -S {sys.argv[0]} SOCKET (-m speedtronic | SCRIPT) ARGS...")
    pending: list[int] = []
    child = [0]

    def pass_on(number, _frame):
        if child[0]:
            os.kill(child[0], number)
        else:
            pending.append(number)

    for number in PASSED_ON:
        signal.signal(number, pass_on)
    command = {"args": args[2:]} if args[0] == "-m" else {"script": args[0], "args": args[1:]}
    request = {
        **command,
        "cwd": os.getcwd(),
        # `python -u`, as torchrun starts a Python rank
        "env": {**os.environ, "PYTHONUNBUFFERED": "1"},
        "new_session": False,
        "hangup_kills": True,
        # its CPU seconds are counted with its launcher's, when the server forked that too
        "bill_to": os.getppid(),
        # at this process's priority (a bench starts its nodes below its own)
        "niceness": os.nice(0),
    }
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(path)
        socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
        answer = connection.recv(4096).decode()
    except OSError:
        answer = ""
    if not answer.startswith("pid "):
        connection.close()
        fresh(args, pending)
    child[0] = int(answer.split()[1])
    for number in pending:
        os.kill(child[0], number)
    while True:
        try:
            answer = connection.recv(4096).decode()
            break
        except InterruptedError:  # a signal passed on meanwhile
            continue
    if not answer.startswith("exit "):
        print(f"forkrank: the fork server lost rank {child[0]}: {answer!r}", file=sys.stderr)
        os._exit(1)
    end_as(int(answer.split()[1]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
