"""Path keys read as a shell user writes them (`~`, `$VAR`), and a node id that fits a file name:
what the configuration accepts is what training can use, and what it refuses is named in one line.
"""

from __future__ import annotations

from pathlib import Path

from conftest import ok, one_error_line, run_cli, tiny_config


def test_tilde_and_a_set_variable_are_expanded_in_path_keys(tmp_path):
    home, work, logs = tmp_path / "home", tmp_path / "work", tmp_path / "logs"
    home.mkdir(), work.mkdir()
    cfg = tiny_config(
        work,
        run={"output_dir": "~/runs/demo"},
        logging={"json_file": "${SPT_LOGS}/metrics.jsonl"},
    )
    env = {"HOME": str(home), "SPT_LOGS": str(logs)}
    ok(run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=work, env=env))
    assert sorted(p.name for p in (home / "runs" / "demo" / "checkpoints").glob("step_*.pt"))
    assert (logs / "metrics.jsonl").read_text().count('"train_step"') == 4
    # no folder named ~ or ${SPT_LOGS}
    assert sorted(p.name for p in work.iterdir()) == ["cfg.yaml"]


def test_an_unset_variable_is_refused_naming_the_key_and_the_variable(tmp_path):
    cfg = tiny_config(tmp_path, checkpoint={"directory": "${SPT_NOT_SET_ANYWHERE}/ck"})
    for command in (["validate"], ["train", "--device", "cpu"]):
        proc = run_cli(command[0], "--config", str(cfg), *command[1:], cwd=tmp_path)
        one_error_line(proc, "checkpoint.directory", "${SPT_NOT_SET_ANYWHERE}")
    assert not any("SPT_NOT_SET" in str(p) for p in tmp_path.rglob("*"))  # nothing created


def test_a_home_of_an_unknown_user_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, run={"output_dir": "~no-such-user-spt/runs"})
    one_error_line(
        run_cli("validate", "--config", str(cfg), cwd=tmp_path),
        "run.output_dir",
        "~no-such-user-spt",
    )
    assert not (tmp_path / "~no-such-user-spt").exists()


def test_a_node_id_too_long_for_a_file_name_is_refused_by_validate(tmp_path):
    cfg = tiny_config(tmp_path, distributed={"node_id": "n" * 300})
    line = one_error_line(
        run_cli("validate", "--config", str(cfg), cwd=tmp_path), "distributed.node_id", "96"
    )
    assert len(line) < 300, line  # names the key, does not echo the whole id
    good = tiny_config(tmp_path, "good.yaml", distributed={"node_id": "ada.l_1@lab-2"})
    ok(run_cli("validate", "--config", str(good), cwd=tmp_path))


def test_a_node_id_with_a_space_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, distributed={"node_id": "ada lovelace"})
    one_error_line(run_cli("validate", "--config", str(cfg), cwd=tmp_path), "distributed.node_id")
    assert Path(cfg).exists()
