"""Every user error ends `cgym` with one `error:` line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
from cgym.trainer.finite import NonFiniteError

from cgym.cli import main

API = ["--env", "cgym/ApiReport-v0"]
SQL = ["--env", "cgym/SqlQuery-v0"]
EVAL = ["eval", *API, "--policy", "scripted:oracle", "--episodes", "1"]
TRAIN = ["train", *API, "--model", "tiny", "--out", "{tmp}/run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD = [
    pytest.param([*EVAL, "--env-kwargs", '{"faults": 2}'], "faults", id="faults-out-of-range"),
    pytest.param([*EVAL, "--env-kwargs", '{"faults": "x"}'], "faults", id="faults-not-a-number"),
    pytest.param(["eval", *SQL, "--policy", "scripted:oracle", "--env-kwargs", '{"query_timeout_s": 0}'], "query_timeout_s", id="query-timeout-zero"),
    pytest.param(["eval", *SQL, "--policy", "scripted:oracle", "--env-kwargs", '{"max_turns": 0}'], "max_turns", id="sql-max-turns-zero"),
    pytest.param([*EVAL, "--env-kwargs", '{"max_turns": 0}'], "max_turns", id="api-max-turns-zero"),
    pytest.param([*EVAL, "--env-kwargs", '{"difficulty": "hardest"}'], "difficulty", id="bad-choice"),
    pytest.param([*EVAL, "--env-kwargs", '{"bogus": 1}'], "bogus", id="unknown-kwarg"),
    pytest.param([*EVAL, "--env-kwargs", "[1]"], "JSON object", id="kwargs-not-an-object"),
    pytest.param(["eval", "--env", "cgym/Nope-v0", "--policy", "scripted:oracle"], "no env registered", id="unknown-env"),
    pytest.param([*EVAL[:-1], "0"], "--episodes", id="episodes-zero"),
    pytest.param([*EVAL, "--samples", "0"], "--samples", id="samples-zero"),
    pytest.param([*EVAL, "--batch-size", "0"], "--batch-size", id="batch-size-zero"),
    pytest.param([*EVAL, "--temperature", "-1"], "--temperature", id="temperature-negative"),
    pytest.param([*EVAL, "--top-p", "0"], "--top-p", id="top-p-zero"),
    pytest.param([*EVAL, "--max-new-tokens", "0"], "--max-new-tokens", id="max-new-tokens-zero"),
    pytest.param(["play", "cgym/ApiReport-v0", "--seed", "-5"], "--seed", id="play-negative-seed"),
    pytest.param(["eval", *API, "--policy", "hf:{tmp}/no/such/model"], "no model at", id="hf-missing-model"),
    pytest.param(["eval", *API, "--policy", "hf:{tmp}"], "cannot load the model", id="hf-not-a-model-directory"),
    pytest.param(["eval", *API, "--policy", "openai:bad"], "openai:<model>@<base_url>", id="openai-malformed"),
    pytest.param(["eval", *API, "--policy", "openai:m@http://127.0.0.1:{port}/v1?max_retries=0"], "ConnectError", id="openai-unreachable"),
    pytest.param(["eval", *API, "--policy", "openai:m@http://127.0.0.1:{port}/v1?max_retrys=1"], "Did you mean 'max_retries'", id="openai-unknown-option"),
    pytest.param(["eval", *API, "--policy", "openai:m@http://127.0.0.1:{port}/v1?timeout_s=0"], "timeout_s", id="openai-bad-option"),
    pytest.param(
        ["eval", *API, "--policy", "vllm:Qwen/Qwen2.5-0.5B-Instruct"], "vLLM is not installed", id="vllm-missing",
        marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed"),
    ),  # fmt: skip
    pytest.param(["eval", *API, "--policy", "scriptd:oracle"], "Did you mean 'scripted'", id="unknown-policy-kind"),
    pytest.param([*TRAIN, "--steps", "0"], "steps must be >= 1", id="train-steps-zero"),
    pytest.param([*TRAIN, "--group-size", "1"], "group_size must be >= 2", id="train-group-of-one"),
    pytest.param([*TRAIN, "--seed", "-1"], "seed must be >= 0", id="train-negative-seed"),
    pytest.param([*TRAIN, "--lr", "0"], "learning_rate", id="train-lr-zero"),
    pytest.param([*TRAIN, "--critique", "steps"], "Did you mean 'step'", id="train-critique-typo"),
    pytest.param([*TRAIN, "--critique", "stepp"], "Did you mean 'step'", id="train-critique-stepp"),
    pytest.param([*TRAIN, "--loss-type", "dapoo"], "invalid choice: 'dapoo'", id="train-loss-type-typo"),
    pytest.param([*TRAIN, *SQL, "--env-kwargs", '{"cgym/ApiReport-v0": {}, "cgym/SqlQuery-v0": {"difficulty": "hardest"}}'], "difficulty='hardest'", id="train-mix-bad-kwargs-of-one-env"),
    pytest.param([*TRAIN, *SQL, "--env-weights", "1"], "env_weights has 1 values for 2 envs", id="train-mix-weights-count"),
    pytest.param([*TRAIN, "--eval-temperature", "-1"], "eval_temperature must be >= 0", id="train-eval-temperature-negative"),
    pytest.param([*TRAIN, "--temperature", "-1"], "--temperature", id="train-temperature-negative"),
    pytest.param([*EVAL, "--policy", "py:no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'", id="py-module-missing"),
    pytest.param([*EVAL, "--policy", "py:json:loadz"], "json has no attribute 'loadz'", id="py-attribute-missing"),
    pytest.param([*EVAL, "--json", "{tmp}/a-file/out.json"], "cannot write --json", id="json-unwritable"),
    pytest.param([*EVAL, "--json", "{tmp}"], "is a directory", id="json-is-a-directory"),
    pytest.param(["audit", *API, "--episodes", "0"], "--episodes", id="audit-episodes-zero"),
    pytest.param(["sft", *API, "--out", "{tmp}/sft", "--episodes", "0"], "--episodes", id="sft-episodes-zero"),
    pytest.param(["compare", *API, "--before", "scripted:oracle"], "--before and --after", id="compare-one-arm"),
    pytest.param([*EVAL, "--env-kwargs", '{"rubric": "x"}'], "rubric", id="kwarg-of-the-wrong-type"),
    pytest.param([*EVAL, "--env-kwargs", "[" * 5000 + "]" * 5000], "--env-kwargs", id="kwargs-nested-deeply"),
    pytest.param([*EVAL, "--env-kwargs", '{"a": ' * 3000 + "1" + "}" * 3000], "--env-kwargs", id="kwargs-object-nested-deeply"),
    pytest.param(["sft", *API, "--out", "{tmp}/sft", "--episodes", "1", "--model", "{tmp}/no/such/model"], "no model at", id="sft-model-missing"),
    pytest.param(["sft", *API, "--out", "{tmp}/sft", "--episodes", "1", "--model", "./missing-model"], "no model at", id="sft-model-relative-missing"),
    pytest.param(["sft", *API, "--out", "{tmp}/sft", "--episodes", "1", "--model", "{tmp}/a-file.gguf"], "gguf", id="sft-model-fake-gguf"),
    pytest.param(["eval", *API, "--policy", "hf:{tmp}/a-file.gguf"], "gguf", id="hf-fake-gguf"),
    pytest.param(["eval", *API, "--policy", "hf:{tmp}/no-tokenizer"], "tokenizer", id="hf-model-without-tokenizer"),
    pytest.param(["eval", *API, "--policy", "hf:{tmp}/truncated"], "cannot load the model", id="hf-truncated-weights"),
    pytest.param([*TRAIN[:-1], "{tmp}/old-run"], "already holds a run", id="train-out-holds-a-run"),
]


def _tiny_model_without(directory: Path, missing: str | None, truncate: str | None = None) -> None:
    """A saved model folder with one file gone or cut short (config.json alone is enough to look like a model)."""
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 4}')
    (directory / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b'{"a": 1}')
    if truncate:
        (directory / "tokenizer.json").write_text("{}")
        (directory / truncate).write_bytes((directory / truncate).read_bytes()[:4])


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), BAD)
def test_user_errors_are_one_line_and_exit_2(argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "a-file.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "old-run" / "checkpoints").mkdir(parents=True)
    _tiny_model_without(tmp_path / "no-tokenizer", "tokenizer.json")
    _tiny_model_without(tmp_path / "truncated", None, truncate="model.safetensors")
    port = _free_port()
    code, err = run_cli([arg.replace("{tmp}", str(tmp_path)).replace("{port}", str(port)) for arg in argv], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    assert expected in lines[0]


def test_an_unwritable_json_path_fails_before_the_evaluation(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import cgym.agents.eval.evaluate

    def must_not_run(*args, **kwargs):
        raise AssertionError("the evaluation ran although its result could not be written")

    monkeypatch.setattr(cgym.agents.eval.evaluate, "evaluate", must_not_run)
    (tmp_path / "a-file").write_text("")
    code, err = run_cli([*EVAL, "--json", str(tmp_path / "a-file" / "out.json")], capsys)
    assert code == 2 and "cannot write --json" in err


def test_a_diverged_run_exits_2_with_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import cgym.trainer.grpo

    def diverge(config, **kwargs):
        raise NonFiniteError("step 3: the loss is nan (the weights or the update diverged)")

    monkeypatch.setattr(cgym.trainer.grpo, "train", diverge)
    code, err = run_cli(["train", *API, "--model", "tiny", "--out", str(tmp_path / "run"), "--eval-episodes", "0"], capsys)
    assert code == 2
    assert err.strip().splitlines() == ["error: step 3: the loss is nan (the weights or the update diverged)"]


def test_a_model_cache_that_is_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("CGYM_CACHE", str(tmp_path / "cache"))
    code, err = run_cli(["eval", *API, "--policy", "hf:smollm2-135m", "--episodes", "1"], capsys)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "is a file, not a folder" in err


@pytest.mark.parametrize("command", ["sft", "eval"])
def test_a_model_without_a_chat_template_is_one_line(command: str, tiny_chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A base model (or a folder saved without its template) is refused in words, by sft and eval alike."""
    import json
    import shutil

    model = shutil.copytree(tiny_chat_model, tmp_path / "base-model")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["sft", *API, "--out", str(tmp_path / "sft"), "--episodes", "1", "--model", str(model)] if command == "sft" else [*EVAL[:3], "--policy", f"hf:{model}", "--episodes", "1"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "has no chat template" in err
