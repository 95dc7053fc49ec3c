"""Ctrl-C with real signals, in a child process: the last completed step is saved, a second Ctrl-C
during that save waits for it, a third abandons it and the message says so, and the CLI keeps its
exit code.

The model of the child process is the reference transformer that sends its own process SIGINT in the
forward pass of step 5 (the first Ctrl-C, at a known step: steps 1-4 are complete, step 3 has an
interval checkpoint), and whose `state_dict()`, while the run is saving because of a Ctrl-C, says so
on stderr and blocks reading a line from its stdin, which the test writes to let it go: a save that
takes long enough to press Ctrl-C into, as a big model or a slow disk gives. No sleeps and no timing
assertions: the test waits on the child's output lines (a condition its reader threads signal) and
on the process; the timeouts only bound how long a condition may take to become true.
"""

import json, os, signal, subprocess, sys, threading
from pathlib import Path

import pytest
from conftest import spawn

ROOT = Path(__file__).resolve().parents[2]

SAVING = "slow_to_save: saving after a Ctrl-C"

SLOW_MODEL = (
    """
import os, signal, sys
import torch
from speedtronic.model import ReferenceTransformer
from speedtronic.registry import register_model

class SlowToSave(ReferenceTransformer):
    '''The reference model: Ctrl-C in the forward pass of step 5; while a Ctrl-C is handled,
    state_dict() waits for the test.'''
    calls = 0
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            type(self).calls += 1
            if self.calls == 5:
                os.kill(os.getpid(), getattr(signal, os.environ.get('STOP_SIGNAL', 'SIGINT')))
        return super().forward(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):   # the save that a Ctrl-C started
            print("%s", file=sys.stderr, flush=True)
            sys.stdin.readline()                                 # the test's go (or its end: EOF)
        return super().state_dict(*args, **kwargs)

register_model("slow_to_save", SlowToSave)
"""
    % SAVING
)

CONFIG = """
run: {max_steps: 100000, output_dir: out, seed: 0}
model: {name: slow_to_save, imports: [slow_save_model], vocab_size: 64, max_seq_len: 16, n_layer: 1,
        n_head: 2, d_model: 16}
data: {num_tokens: 64, micro_batch_size: 2, target_batch_size: 2}
checkpoint: {every_steps: 3, keep_last: null}
logging: {json_file: out/metrics.jsonl, progress: false, level: WARNING}
"""

CHILD = """
import json, sys
from speedtronic.config import SpeedtronicConfig
from speedtronic.runtime import train_from_config
from speedtronic.trainer import TrainingInterrupted
try: train_from_config(SpeedtronicConfig.load("run.yaml"), device="cpu")
except TrainingInterrupted as stop:
    result = {"message": str(stop), "saved": stop.saved, "checkpoint": str(stop.checkpoint),
              "steps": stop.result.steps, "records": len(stop.result.metrics)}
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(3)
"""

STARTED: list[subprocess.Popen] = []  # every child of the current test, ended by the `work` fixture


class Child:
    """A training process whose output lines are collected as they come; each new line (and each
    stream's end) is signalled."""

    def __init__(
        self, args: list[str], cwd: Path, stop_signal: str = "SIGINT", env: dict | None = None
    ):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)]),
            "OMP_NUM_THREADS": "1",
            "STOP_SIGNAL": stop_signal,
            **(env or {}),
        }
        self.proc = spawn(
            args,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        STARTED.append(self.proc)
        self.out, self.err, self.ended = [], [], 0
        self.changed = threading.Condition()
        self.readers = [
            threading.Thread(target=self._read, args=pair, daemon=True)
            for pair in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in iter(stream.readline, ""):
            with self.changed:
                sink.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended += 1
            self.changed.notify_all()

    def wait_for(self, condition, what: str, timeout: float = 240) -> None:
        "Wait until `condition()` holds; fail at once if the child's output ends first."
        with self.changed:
            self.changed.wait_for(lambda: condition() or self.ended == 2, timeout)
            if condition():
                return
            state = (
                f"the child ended (rc={self.proc.wait(60)}) before"
                if self.ended == 2
                else f"within {timeout}s no"
            )
        raise AssertionError(f"{state} {what}:\n{''.join(self.err)[-3000:]}")

    def saving(self) -> None:
        "Wait until the child's save after the first Ctrl-C has begun (and is held)."
        self.wait_for(lambda: f"{SAVING}\n" in self.err, "save after the first Ctrl-C")

    def release(self) -> None:
        "Let the held save go on (a line written now waits in the pipe for a save still to come)."
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def ctrl_c(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> int:
        """The exit code, once the child has exited and both reader threads have taken its last
        lines."""
        try:
            rc = self.proc.wait(240)  # stdin stays open: its end would let a held save go on
        finally:
            self.proc.stdin.close()
        for reader in self.readers:
            reader.join(60)
        assert not any(r.is_alive() for r in self.readers), (
            "the output pipes stayed open after the child exited"
        )
        return rc

    def result(self) -> dict:
        line = next(l for l in self.out if l.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])


@pytest.fixture
def work(tmp_path):
    (tmp_path / "slow_save_model.py").write_text(SLOW_MODEL)
    (tmp_path / "run.yaml").write_text(CONFIG)
    (tmp_path / "child.py").write_text(CHILD)
    yield tmp_path
    while STARTED:  # a test that failed half way leaves no process behind
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)


def _start_and_interrupt(work: Path) -> Child:
    "Start training (Ctrl-C comes in step 5) and wait until the save of step 4 starts."
    child = Child([sys.executable, "child.py"], work)
    child.saving()
    return child


def _checkpoints(work: Path) -> list[str]:
    return sorted(p.name for p in (work / "out" / "checkpoints").iterdir())


def test_a_second_ctrl_c_waits_for_the_save(work):
    child = _start_and_interrupt(work)
    child.ctrl_c()  # pressed again while the step is being saved
    child.wait_for(lambda: "still saving step" in "".join(child.err), "note that the save goes on")
    child.release()
    assert child.finish() == 3, "".join(child.err)[-3000:]
    got = child.result()
    step = got["steps"]
    assert got["saved"] is True and step == 4 and got["records"] == step, got
    assert f"step {step} is saved in" in got["message"] and "resume=True" in got["message"], got[
        "message"
    ]
    assert f"step_{step:012d}.pt" in _checkpoints(work)
    assert not [n for n in _checkpoints(work) if ".tmp-" in n]  # no temp file left behind
    assert f".step_{step:012d}.pt.sha256.json" in _checkpoints(work)  # its hash record is there
    from speedtronic.checkpoint import CheckpointManager

    state = CheckpointManager(work / "out" / "checkpoints").load_latest()
    assert state["step"] == step


def test_a_third_ctrl_c_abandons_the_save_and_says_so(work):
    child = _start_and_interrupt(work)
    child.ctrl_c()
    child.wait_for(lambda: "still saving step" in "".join(child.err), "note that the save goes on")
    child.ctrl_c()  # a third press: give up the save
    assert child.finish() == 3, "".join(child.err)[-3000:]
    got = child.result()
    step = got["steps"]
    assert got["saved"] is False and step == 4, got
    assert f"step {step} was NOT saved (interrupted again while saving)" in got["message"], got[
        "message"
    ]
    newest = max(n for n in _checkpoints(work) if n.startswith("step_"))
    assert (
        newest == "step_000000000003.pt"
        and f"the newest checkpoint is out/checkpoints/{newest}." in got["message"]
    ), got["message"]
    assert f"step_{step:012d}.pt" not in _checkpoints(work)
    # the abandoned save left no temp file, and no hash record of a file that is not there
    assert not [n for n in _checkpoints(work) if ".tmp-" in n or n.startswith(f".step_{step:012d}")]
    from speedtronic.checkpoint import CheckpointManager

    assert CheckpointManager(work / "out" / "checkpoints").load_latest()["step"] == 3


def test_cli_ctrl_c_saves_and_exits_130(work):
    "`speedtronic train` keeps its behaviour: the step is saved, one error line, exit code 130."
    child = Child(
        [sys.executable, "-m", "speedtronic", "train", "--config", "run.yaml", "--device", "cpu"],
        work,
    )
    child.release()  # this save does not wait
    assert child.finish() == 130
    assert "".join(child.err).strip().splitlines()[-1] == "speedtronic: error: interrupted", (
        "".join(child.err)[-2000:]
    )
    assert "Traceback" not in "".join(child.err)
    from speedtronic.checkpoint import CheckpointManager

    assert CheckpointManager(work / "out" / "checkpoints").load_latest()["step"] == 4


RESUME_CHILD = """
import json, os
from speedtronic.checkpoint import CheckpointError
from speedtronic.config import SpeedtronicConfig
from speedtronic.paths import lock_holder
from speedtronic.runtime import train_from_config
from speedtronic.trainer import TrainingInterrupted
config = SpeedtronicConfig.load("run.yaml")
try: train_from_config(config, device="cpu")
except TrainingInterrupted as stop: first = stop.result.steps
# the interrupted run let go of its directory
holder = lock_holder("out") or os.path.exists("out/.speedtronic.lock") or None
try: train_from_config(config, device="cpu", max_steps=first + 2); fresh = "trained"
except CheckpointError as e: fresh = str(e)
result = train_from_config(config, device="cpu", resume=True, max_steps=first + 2)
after = os.path.exists("out/.speedtronic.lock") or None
history = [m["step"] for m in result.metrics]
report = {"first": first, "holder": holder, "fresh": fresh}
report.update(steps=result.steps, history=history, after=after)
print("RESULT " + json.dumps(report), flush=True)
"""


def test_an_interrupted_run_releases_its_directory_and_resumes_in_the_same_process(work):
    """After the interrupt the lock is gone: a fresh run there is refused (another run's
    checkpoints), resume=True goes on."""
    (work / "resume_child.py").write_text(RESUME_CHILD)
    child = Child([sys.executable, "resume_child.py"], work)
    child.release()
    assert child.finish() == 0, "".join(child.err)[-3000:]
    got = child.result()
    assert got["first"] == 4 and got["holder"] is None and got["after"] is None, got
    assert (
        "already holds checkpoints of run" in got["fresh"]
        and "--resume (resume=True)" in got["fresh"]
    ), got["fresh"]
    assert got["steps"] == 6 and got["history"] == [1, 2, 3, 4, 5, 6], got
    from speedtronic.checkpoint import CheckpointManager

    assert CheckpointManager(work / "out" / "checkpoints").load_latest()["step"] == 6


def test_cli_sigterm_saves_and_exits_143(work):
    """SIGTERM during `speedtronic train` (a scheduler stopping the job): the step is saved, one
    line, exit 143."""
    child = Child(
        [sys.executable, "-m", "speedtronic", "train", "--config", "run.yaml", "--device", "cpu"],
        work,
        stop_signal="SIGTERM",
    )
    child.release()
    assert child.finish() == 143, "".join(child.err)[-3000:]
    assert (
        "".join(child.err).strip().splitlines()[-1] == "speedtronic: error: terminated (SIGTERM)"
    ), "".join(child.err)[-2000:]
    assert "Traceback" not in "".join(child.err)
    from speedtronic.checkpoint import CheckpointManager

    # the step in flight completes
    assert CheckpointManager(work / "out" / "checkpoints").load_latest()["step"] == 5


# ----------------------------------------------------- a Ctrl-C in a step that owes a held-out eval

EVALUATING = "stops_in_eval: evaluating"
TERM_NOTED = "stops_in_eval: SIGTERM reached the run's handler"

EVAL_MODEL = """
import os, signal, sys
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from speedtronic.model import ReferenceTransformer
from speedtronic.registry import register_model

class StopsInEval(ReferenceTransformer):
    '''The reference model, pressed Ctrl-C on by its optimizer (UPDATE_PRESS) or the test
    (HOLD_EVAL) at step 4.'''
    held = False
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled() and os.environ.get("HOLD_EVAL") and not StopsInEval.held:
            StopsInEval.held = True  # the first held-out batch of step 4
            handler = signal.getsignal(signal.SIGTERM)           # the run's: says so, then acts
            def noted(signum, frame):
                print("%s", file=sys.stderr, flush=True)
                return handler(signum, frame)
            if callable(handler): signal.signal(signal.SIGTERM, noted)
            print("%s", file=sys.stderr, flush=True)
            sys.stdin.readline()                                 # the test presses Ctrl-C now
        return super().forward(*args, **kwargs)

updates = 0
def press_in_update(optimizer, args, kwargs):
    '''Ctrl-C (or STOP_SIGNAL) inside the optimizer update of step 4, where the trainer holds it
    until the step is complete.'''
    global updates
    updates += 1
    if updates == 4 and os.environ.get("UPDATE_PRESS"):
        signal.raise_signal(getattr(signal, os.environ.get("STOP_SIGNAL", "SIGINT")))

register_optimizer_step_pre_hook(press_in_update)
register_model("stops_in_eval", StopsInEval)
""" % (TERM_NOTED, EVALUATING)

EVAL_CONFIG = """
run: {max_steps: 8, output_dir: out, seed: 0}
model: {name: stops_in_eval, imports: [stops_in_eval_model], vocab_size: 256, max_seq_len: 16,
        n_layer: 1, n_head: 2, d_model: 16}
data: {text_path: text.txt, block_size: 16, micro_batch_size: 2, target_batch_size: 2}
eval: {holdout_fraction: 0.25, every_steps: 4, max_batches: 2, sample_prompts: ["the "],
       sample_tokens: 4}
checkpoint: {every_steps: 100, keep_last: null}
logging: {json_file: out/metrics.jsonl, progress: false, level: WARNING}
"""

TRAIN = [sys.executable, "-m", "speedtronic", "train", "--config", "run.yaml", "--device", "cpu"]


@pytest.fixture
def eval_work(tmp_path):
    (tmp_path / "stops_in_eval_model.py").write_text(EVAL_MODEL)
    (tmp_path / "run.yaml").write_text(EVAL_CONFIG)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran"]
    (tmp_path / "text.txt").write_text(" ".join(words[(i * 7) % 9] for i in range(3000)))
    yield tmp_path
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)


def _events(work: Path, event: str) -> list[dict]:
    lines = (work / "out" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _saved(work: Path) -> dict:
    from speedtronic.checkpoint import CheckpointManager

    return CheckpointManager(work / "out" / "checkpoints").load_latest()


def test_ctrl_c_in_the_update_of_an_eval_step_runs_its_eval_first(eval_work):
    """A Ctrl-C held through step 4's update: step 4's eval and sample run, then the run stops at
    step 4."""
    child = Child(TRAIN, eval_work, env={"UPDATE_PRESS": "1"})
    assert child.finish() == 130, "".join(child.err)[-3000:]
    assert [r["step"] for r in _events(eval_work, "eval")] == [4], "".join(child.err)[-3000:]
    assert [r["step"] for r in _events(eval_work, "sample")] == [4]
    state = _saved(eval_work)
    assert state["step"] == 4 and state["eval_owed"] is None and state["target"] == 8


@pytest.mark.parametrize("first", ["in the update", "in the eval"])
def test_ctrl_c_during_an_eval_leaves_it_owed_and_resume_runs_it_first(eval_work, first):
    """Ctrl-C while step 4's eval runs (the first press, or a second after one held in the update)
    stops at once."""
    extra = {"HOLD_EVAL": "1", **({"UPDATE_PRESS": "1"} if first == "in the update" else {})}
    child = Child(TRAIN, eval_work, env=extra)
    child.wait_for(lambda: f"{EVALUATING}\n" in child.err, "the eval of step 4")
    child.ctrl_c()  # stops now: the eval it cuts short is owed
    assert child.finish() == 130, "".join(child.err)[-3000:]
    assert "Traceback" not in "".join(child.err)
    assert _events(eval_work, "eval") == [] and _events(eval_work, "sample") == []
    state = _saved(eval_work)
    assert state["step"] == 4 and state["eval_owed"] == 4, (state["step"], state["eval_owed"])

    resumed = Child([*TRAIN, "--resume"], eval_work)
    assert resumed.finish() == 0, "".join(resumed.err)[-3000:]
    lines = (eval_work / "out" / "metrics.jsonl").read_text().splitlines()
    order = [(r["event"], r.get("step")) for r in map(json.loads, lines)]
    order = [e for e in order if e[0] in ("eval", "sample", "train_step") and e[1] >= 4]
    assert order[:3] == [("train_step", 4), ("eval", 4), ("sample", 4)], order
    assert order[3] == ("train_step", 5) and order[-2:] == [("eval", 8), ("sample", 8)], order
    assert [r["step"] for r in _events(eval_work, "eval")] == [4, 8]
    assert _saved(eval_work)["eval_owed"] is None


# ------------------------------------------------------ SIGTERM in a step that owes a held-out eval


def _held_out_order(work: Path) -> list[tuple[str, int]]:
    """The run's train_step, eval and sample events from step 4 on, in the order the metrics file
    has them."""
    lines = (work / "out" / "metrics.jsonl").read_text().splitlines()
    order = [(r["event"], r.get("step")) for r in map(json.loads, lines)]
    return [e for e in order if e[0] in ("eval", "sample", "train_step") and e[1] >= 4]


def _resume_leaves_no_hole(work: Path) -> None:
    "`train --resume` to step 8: step 4's eval and sample come before step 5, every due eval once."
    resumed = Child([*TRAIN, "--resume"], work)
    assert resumed.finish() == 0, "".join(resumed.err)[-3000:]
    order = _held_out_order(work)
    assert order[:4] == [("train_step", 4), ("eval", 4), ("sample", 4), ("train_step", 5)], order
    assert order[-2:] == [("eval", 8), ("sample", 8)], order
    assert [r["step"] for r in _events(work, "eval")] == [4, 8]
    assert [r["step"] for r in _events(work, "sample")] == [4, 8]
    assert _saved(work)["step"] == 8 and _saved(work)["eval_owed"] is None


def test_sigterm_in_the_update_of_an_eval_step_runs_its_eval_first(eval_work):
    """SIGTERM during step 4's update: step 4 completes, its eval and sample run, it is saved, exit
    143."""
    child = Child(TRAIN, eval_work, stop_signal="SIGTERM", env={"UPDATE_PRESS": "1"})
    assert child.finish() == 143, "".join(child.err)[-3000:]
    err = "".join(child.err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "speedtronic: error: terminated (SIGTERM)"
    ), err[-2000:]
    assert [r["step"] for r in _events(eval_work, "eval")] == [4], err[-3000:]
    assert [r["step"] for r in _events(eval_work, "sample")] == [4]
    state = _saved(eval_work)
    assert state["step"] == 4 and state["eval_owed"] is None and state["target"] == 8
    _resume_leaves_no_hole(eval_work)


def test_sigterm_during_an_eval_lets_it_finish_then_stops(eval_work):
    "One SIGTERM while step 4's eval runs: that eval and its sample end, step 4 is saved, exit 143."
    child = Child(TRAIN, eval_work, stop_signal="SIGTERM", env={"HOLD_EVAL": "1"})
    child.wait_for(lambda: f"{EVALUATING}\n" in child.err, "the eval of step 4")
    child.proc.send_signal(signal.SIGTERM)
    child.wait_for(lambda: f"{TERM_NOTED}\n" in child.err, "the run taking the SIGTERM")
    child.release()  # the run's handler has asked for the stop: let the eval go on
    assert child.finish() == 143, "".join(child.err)[-3000:]
    assert "Traceback" not in "".join(child.err)
    assert [r["step"] for r in _events(eval_work, "eval")] == [4]
    assert [r["step"] for r in _events(eval_work, "sample")] == [4]
    state = _saved(eval_work)
    assert state["step"] == 4 and state["eval_owed"] is None, (state["step"], state["eval_owed"])
    _resume_leaves_no_hole(eval_work)


def test_a_second_sigterm_during_an_eval_leaves_it_owed_and_resume_runs_it_first(eval_work):
    "SIGTERM in step 4's update, a second while its eval runs: the stop is at once, the eval owed."
    child = Child(
        TRAIN, eval_work, stop_signal="SIGTERM", env={"UPDATE_PRESS": "1", "HOLD_EVAL": "1"}
    )
    child.wait_for(lambda: f"{EVALUATING}\n" in child.err, "the eval of step 4")
    child.proc.send_signal(signal.SIGTERM)  # the second: the run stops inside the eval
    assert child.finish() == 143, "".join(child.err)[-3000:]
    err = "".join(child.err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "speedtronic: error: terminated (SIGTERM)"
    ), err[-2000:]
    assert _events(eval_work, "eval") == [] and _events(eval_work, "sample") == []
    state = _saved(eval_work)
    assert state["step"] == 4 and state["eval_owed"] == 4, (state["step"], state["eval_owed"])
    _resume_leaves_no_hole(eval_work)
