"""Property tests: no input to the config loader raises anything but ConfigError / FileNotFoundError
(spec §15.3).

Random YAML/JSON text (structured dumps with mutations, and raw noise), random nested dicts, and
near-valid configs built from the real schema with mutated values, deleted and misspelled keys.
Every config that does load must serialise, and load back from its own `to_dict()` to the same
thing. Run with `-s` (or look at the terminal summary line) to see how many inputs were tried.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic.config import ConfigError, SpeedtronicConfig, load_config  # noqa: E402

SETTINGS = dict(
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
COUNTS: dict[str, int] = {}
OUTCOMES = {"loaded and round-tripped": 0, "rejected": 0}
TMP = Path(tempfile.mkdtemp(prefix="speedtronic-fuzz-"))


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    yield
    tried = ", ".join(f"{n} {k}" for k, n in COUNTS.items())
    outcomes = ", ".join(f"{n} {k}" for k, n in OUTCOMES.items())
    line = f"config fuzz: tried {tried} ({sum(COUNTS.values())} inputs; loader calls: {outcomes})"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("\n" + line)


def count(kind: str):
    COUNTS[kind] = COUNTS.get(kind, 0) + 1


# --- the schema, as the fuzzer sees it
# -------------------------------------------------------------------
def _schema() -> dict[str, list[str]]:
    base = SpeedtronicConfig()
    out = {}
    for f in dataclasses.fields(base):
        value = getattr(base, f.name)
        out[f.name] = (
            [g.name for g in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else []
        )
    return out


SCHEMA = _schema()
ALIASES = [
    "name",
    "seed",
    "device",
    "output_dir",
    "max_steps",
    "log_every",
    "hub",
    "diloco",
    "muon_plus",
    "cautious",
]
FIELD_NAMES = sorted({k for keys in SCHEMA.values() for k in keys})
KEYS = st.one_of(
    st.sampled_from(sorted(SCHEMA) + ALIASES),
    st.sampled_from(FIELD_NAMES),
    st.text(max_size=12),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        [
            "auto",
            "none",
            "false",
            "true",
            "3e-4",
            "1e3",
            "10.0",
            "muon",
            "adamw",
            "cosine",
            "bf16",
            "fp16",
            "",
            " ",
            "..",
            "a/b",
            "org/run",
            "hf_xyz",
            "1e400",
            "-0",
            "nan",
            "0x10",
        ]
    ),
    st.dates(),
    st.just(10**400),
    st.just(0).map(lambda _: -(10**5000)),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)


def near_valid_bases() -> list[dict]:
    bases = [SpeedtronicConfig().to_dict()]
    for name in (
        "configs/smoke.yaml",
        "configs/v2_smoke.yaml",
        "configs/diloco.yaml",
        "examples/diloco_master.yaml",
    ):
        bases.append(yaml.safe_load((ROOT / name).read_text()))
    return bases


BASES = near_valid_bases()


def plausible(current):
    """Values of the same kind as `current`, mostly in range, so that many mutated configs still
    load."""
    if isinstance(current, bool):
        return st.booleans()
    if isinstance(current, int):
        return st.one_of(st.integers(0, 64), st.sampled_from([current, 2 * current, current // 2]))
    if isinstance(current, float):
        return st.one_of(st.floats(0, 1, exclude_max=True), st.just(current), st.integers(1, 9))
    if isinstance(current, str):
        return st.sampled_from([current, current.upper(), f" {current} ", "auto", "none"])
    return st.one_of(st.none(), st.integers(1, 8))


@st.composite
def near_valid(draw) -> dict:
    """A real config (default or shipped) with a few values mutated, keys dropped, misspelled or
    aliased."""
    config = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(SCHEMA)))
        op = draw(st.sampled_from(["set"] * 6 + ["drop", "typo", "section", "alias"]))
        body = config.get(section)
        if op == "section":
            config[section] = draw(VALUES)
            continue
        if op == "alias":
            config[draw(st.sampled_from(ALIASES))] = draw(VALUES)
            continue
        if not isinstance(body, dict) or not SCHEMA[section]:
            config[section] = draw(plausible(body) if op == "set" else SCALARS)
            continue
        key = draw(st.sampled_from(SCHEMA[section]))
        if op == "set" and draw(st.booleans()):
            body[key] = draw(plausible(body.get(key)))
        elif op == "set":
            body[key] = draw(st.one_of(SCALARS, VALUES))
        elif op == "drop":
            body.pop(key, None)
        else:
            i = draw(st.integers(0, max(0, len(key) - 1)))
            body[key[:i] + draw(st.sampled_from(["", "_", "s", "x"])) + key[i + 1 :]] = body.pop(
                key, 1
            )
    return config


def _json_text(value) -> str:
    return json.dumps(value, default=str)


@st.composite
def yaml_text(draw) -> str:
    "YAML/JSON-ish text: a dump of near-valid or random data with character edits, or raw noise."
    kind = draw(st.sampled_from(["dump", "dump", "json", "noise"]))
    if kind == "noise":
        return draw(
            st.text(
                alphabet=st.sampled_from(
                    list("abc:- []{}\n\t\"'&*!|>#%@,.?01e+\\") + ["\x00", "é", "\ufeff"]
                ),
                max_size=80,
            )
        )
    data = draw(st.one_of(near_valid(), VALUES))
    try:
        text = yaml.safe_dump(data, sort_keys=False) if kind == "dump" else _json_text(data)
    except (yaml.YAMLError, ValueError, TypeError):
        text = "run: {max_steps: 3}\nseed: [1"
    for _ in range(draw(st.integers(0, 3))):
        if not text:
            break
        i = draw(st.integers(0, len(text) - 1))
        text = (
            text[:i]
            + draw(
                st.sampled_from(["", ":", " ", "\n", "[", "{", "'", "&a ", "*a", "!!", "- ", "\t"])
            )
            + text[i + 1 :]
        )
    return text


# --- the property
# --------------------------------------------------------------------------------------------
def check_loaded(config: SpeedtronicConfig):
    "A loaded config serialises, and reloading its own dict gives the same dict."
    first = config.to_dict()
    config.to_yaml(redact_secrets=True)
    again = load_config(first).to_dict()
    assert json.dumps(again, default=str) == json.dumps(first, default=str)


def only_expected_errors(call):
    try:
        config = call()
    except (ConfigError, FileNotFoundError) as err:
        assert str(err), "an error must say something"
        OUTCOMES["rejected"] += 1
        return
    check_loaded(config)
    OUTCOMES["loaded and round-tripped"] += 1


@settings(max_examples=2000, **SETTINGS)
@given(near_valid())
def test_near_valid_dicts(values):
    count("near-valid dicts")
    only_expected_errors(lambda: SpeedtronicConfig.from_dict(values))


@settings(max_examples=600, **SETTINGS)
@given(st.one_of(st.dictionaries(KEYS, VALUES, max_size=6), VALUES))
def test_random_dicts(values):
    count("random dicts")
    only_expected_errors(lambda: SpeedtronicConfig.from_dict(values))


@settings(max_examples=800, **SETTINGS)
@given(yaml_text())
# what hypothesis found in CI: a \U escape past Unicode's end made PyYAML raise OverflowError
@example('0: []\n-1:\n- null\n- 10\n- "\\x1F\\r\\U00010000\\Ua0010000"\n')
@example('name: "\\U00110000"')
def test_inline_text(text):
    count("inline texts")
    only_expected_errors(lambda: load_config(text))


@settings(max_examples=300, **SETTINGS)
@given(yaml_text(), st.sampled_from([".yaml", ".yml", ".json", ".cfg", ""]), st.booleans())
def test_files(text, suffix, as_bytes):
    count("files")
    path = TMP / f"fuzz{suffix}"
    if as_bytes:
        path.write_bytes(text.encode("utf-8", "surrogatepass") + b"\xff")  # not UTF-8 at the end
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    only_expected_errors(lambda: load_config(path))
    only_expected_errors(lambda: SpeedtronicConfig.from_yaml(path))


def test_specific_nasty_inputs():
    "Inputs the strategies reach only rarely: aliases, self-reference, huge numbers, odd paths."
    nasty = [
        "a: &x [*x]",
        "run: &r {name: *r}",
        "logging: {wandb: &w {a: *w}}",
        "model: {imports: &i [*i]}",
        "[" * 3000,
        "{" * 3000,
        "max_steps: " + "9" * 5000,
        "optimizer: {lr: 1e400}",
        '{"seed": ' + "1" * 5000 + "}",
        "!!python/object:os.system {}",
        "? [a, b]\n: c",
        "run: !!binary aGVsbG8=",
        "---\na: 1\n---\nb: 2",
        "\x00",
        "",
        "   ",
        ".",
        "/",
        "\ufeffrun: {}",
        "seed: 2024-01-01",
        "name: 2024-01-01",
        {"run": None},
        {"seed": True},
        {"compile": {"enabled": "yes"}},
        {"precision": 16},
        {None: 1},
        {1.5: 2},
        {"data": {"dataset": object()}},
        {"logging": {"wandb": {1: 2}}},
        {"distributed": {"collaborators": [None]}},
    ]
    for source in nasty:
        count("hand-picked inputs")
        only_expected_errors(lambda: load_config(source))
