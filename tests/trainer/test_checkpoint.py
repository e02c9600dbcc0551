"""Checkpoints: weights_only loading, manifest verification, fallback, the non-finite guard, metrics on resume."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from cgym.agents.options import SamplingOptions
from cgym.envs.errors import CgymError, ConfigError
from cgym.trainer import grpo
from cgym.trainer.checkpoint import MANIFEST, STATE_FILE, CheckpointError, latest_checkpoint, load_state, save_checkpoint, verify_checkpoint
from cgym.trainer.config import TrainConfig
from cgym.trainer.finite import NonFiniteError, check_finite
from cgym.trainer.grpo import rewind_metrics, train
from cgym.trainer.metrics import MetricsLog

from tests.trainer.test_grpo import ToyEnv  # one-turn toy env: the reward is the share of "a"


# -- a checkpoint without a real model: what the manifest and the state file must hold ---------
class _FakePretrained:
    """Stands in for a model and a tokenizer: `save_pretrained` writes one file."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / self.name).write_bytes(bytes(range(256)) * 64)


def _optimizer() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def _save(directory: Path, step: int) -> Path:
    optimizer, scheduler = _optimizer()
    return save_checkpoint(directory, model=_FakePretrained("model.safetensors"), tokenizer=_FakePretrained("tokenizer.json"), optimizer=optimizer, scheduler=scheduler, step=step, config={"seed": 0})


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_state_round_trips_with_weights_only_and_restores_the_rngs(tmp_path: Path) -> None:
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    directory = _save(tmp_path / "step-1", step=1)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    optimizer, scheduler = _optimizer()
    assert load_state(directory, optimizer=optimizer, scheduler=scheduler) == 1
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]
    torch.load(directory / STATE_FILE, weights_only=True)  # plain tensors and values only
    assert set(json.loads((directory / MANIFEST).read_text())["files"]) == {"model.safetensors", "tokenizer.json", STATE_FILE, "train_config.json"}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: _flip_byte(d / "model.safetensors"), "sha256"),
        (lambda d: _truncate(d / STATE_FILE), "truncated"),
        (lambda d: (d / "tokenizer.json").unlink(), "lacks tokenizer.json"),
        (lambda d: (d / "pytorch_model.bin").write_bytes(b"planted"), "does not list"),
        (lambda d: (d / MANIFEST).unlink(), "no manifest.json"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "not a valid manifest"),
    ],
    ids=["bit-flip", "truncated", "missing-file", "extra-file", "no-manifest", "bad-manifest"],
)
def test_damaged_newest_checkpoint_falls_back_to_the_last_good_one(tmp_path: Path, damage, message: str) -> None:
    good = _save(tmp_path / "checkpoints" / "step-2", step=2)
    newest = _save(tmp_path / "checkpoints" / "step-4", step=4)
    damage(newest)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(newest)
    with pytest.warns(UserWarning, match=r"step-4.*resuming from .*step-2"):
        assert latest_checkpoint(tmp_path) == good


def test_no_good_checkpoint_left_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None  # nothing to resume: a fresh run
    only = _save(tmp_path / "checkpoints" / "step-3", step=3)
    _flip_byte(only / STATE_FILE)
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* passes its check .*step-3"):
        latest_checkpoint(tmp_path)


class _Planted:
    """A pickle payload: unpickling it with weights_only=False would create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    directory = _save(tmp_path / "checkpoints" / "step-2", step=2)
    torch.save({"step": 2, "optimizer": _Planted(marker)}, directory / STATE_FILE)
    with pytest.raises(CheckpointError, match="trainer_state.pt"):  # the manifest no longer matches
        latest_checkpoint(tmp_path)
    manifest = json.loads((directory / MANIFEST).read_text())  # an attacker who also rewrites the manifest
    manifest["files"][STATE_FILE] = {"bytes": (directory / STATE_FILE).stat().st_size, "sha256": hashlib.sha256((directory / STATE_FILE).read_bytes()).hexdigest()}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    assert latest_checkpoint(tmp_path) == directory
    optimizer, scheduler = _optimizer()
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_state(directory, optimizer=optimizer, scheduler=scheduler)
    assert not marker.exists()


def test_rewind_metrics_keeps_the_rows_up_to_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/success_rate": 0.1}, *({"step": s, "loss": 0.5} for s in range(1, 6))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')  # torn by a crash
    with pytest.warns(UserWarning, match="unreadable"):
        assert rewind_metrics(path, 3) == [7]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    rewind_metrics(path, 0)
    assert not path.exists()


@pytest.mark.parametrize("garbage", ["not json", "[1, 2]", '{"step": "x"}', "\x00\x01"], ids=["text", "array", "bad-step", "binary"])
def test_a_bad_line_anywhere_loses_no_valid_row_on_resume(tmp_path: Path, garbage: str) -> None:
    """Any line that is not a metrics row is skipped and reported; the rows around it stay, and
    the file as it was is kept beside it."""
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 0.5}) for s in range(1, 6)]
    original = "\n".join([*rows[:2], garbage, *rows[2:]]) + "\n"
    path.write_text(original)
    with pytest.warns(UserWarning, match="line"):
        assert rewind_metrics(path, 4) == [3]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl.1.bak").read_text() == original


@pytest.mark.parametrize("value", [float("nan"), float("inf"), torch.tensor(float("-inf"))], ids=["nan", "inf", "tensor-neg-inf"])
def test_check_finite_raises_a_cgym_error(value) -> None:
    with pytest.raises(NonFiniteError, match="step 7: the loss is") as info:
        check_finite("loss", value, step=7)
    assert isinstance(info.value, CgymError)
    check_finite("loss", torch.tensor(0.5))


# -- the real loop on a one-turn toy env and the tiny model -----------------------------------
def _toy(split: str) -> ToyEnv:
    return ToyEnv()


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One intra-op thread (tiny tensors, a busy 2-core box) and no learning-curve PNG."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(grpo, "plot_curve", lambda *args, **kwargs: None)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cgym.trainer.tiny import build_tiny

    rng = np.random.default_rng(0)
    words = ["banana", "apple", "cat", "aaa", "baba", "zzz", "data"]
    corpus = [" ".join(rng.choice(words, 8)) for _ in range(100)]
    return build_tiny(tmp_path_factory.mktemp("tiny"), corpus, vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=256)


def _config(model: Path, out: Path, **overrides) -> TrainConfig:
    base = dict(env_id="toy", model=str(model), out=str(out), steps=4, group_size=4, tasks_per_step=1, learning_rate=3e-3, sampling=SamplingOptions(max_new_tokens=4), micro_batch_size=4, save_every=2, progress=False, seed=0, lora_r=0)
    return TrainConfig(**{**base, **overrides})


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_skips_a_damaged_checkpoint_and_logs_each_step_once(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(_config(tiny_model, out, steps=2, save_every=1), make_env=_toy)
    _flip_byte(out / "checkpoints" / "step-2" / "model.safetensors", offset=-200)
    with pytest.warns(UserWarning, match=r"step-2.*resuming from .*step-1"):
        result = train(_config(tiny_model, out, steps=3, save_every=1), make_env=_toy, resume=True)
    assert result["steps"] == 3
    assert _steps(out) == [1, 2, 3]


def test_a_non_finite_loss_stops_the_run_before_the_update(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    real_loss = grpo.policy_loss
    calls = {"n": 0}

    def diverging(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 2 else loss), stats  # micro-batch 3 = step 3

    monkeypatch.setattr(grpo, "policy_loss", diverging)
    with pytest.raises(NonFiniteError, match="step 3: the loss is nan"):
        train(_config(tiny_model, out), make_env=_toy)
    assert _steps(out) == [1, 2]
    verify_checkpoint(out / "checkpoints" / "step-2")  # the last checkpoint stays good
    assert not (out / "final").exists()


def test_a_non_finite_gradient_skips_the_optimizer_step(tiny_model: Path, tmp_path: Path) -> None:
    state = grpo.setup(_config(tiny_model, tmp_path / "run"), make_env=_toy)
    before = [p.detach().clone() for p in state.model.parameters()]
    next(state.model.parameters()).register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(NonFiniteError, match="step 1: the gradient norm is"):
        grpo.train_step(state, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))


# -- one folder, one run -------------------------------------------------------------------------
def _rehash(directory: Path) -> None:
    """Rewrite the manifest to match the files as they now are (an attacker who can write the folder)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (directory / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_a_folder_holding_a_run_is_resumed_or_overwritten_never_mixed(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(_config(tiny_model, out, steps=2, save_every=1), make_env=_toy)
    with pytest.raises(ConfigError, match=r"already holds a run .*--resume .*--overwrite"):
        train(_config(tiny_model, out, steps=2, save_every=1), make_env=_toy)
    with pytest.raises(ConfigError, match="choose one"):
        train(_config(tiny_model, out, steps=2), make_env=_toy, resume=True, overwrite=True)
    (out / "notes.txt").write_text("mine")
    train(_config(tiny_model, out, steps=1, save_every=1), make_env=_toy, overwrite=True)
    assert _steps(out) == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]  # the old run's step-2 is gone
    assert (out / "notes.txt").read_text() == "mine"  # what the run did not write stays


@pytest.mark.parametrize(("change", "field"), [({"learning_rate": 1e-2}, "learning_rate"), ({"seed": 5}, "seed"), ({"lora_r": 4}, "lora_r")])
def test_resume_refuses_a_different_run_and_takes_a_longer_one(tiny_model: Path, tmp_path: Path, change: dict, field: str) -> None:
    out = tmp_path / "run"
    train(_config(tiny_model, out, steps=1, save_every=1), make_env=_toy)
    with pytest.raises(ConfigError, match=rf"different run .*{field} was"):
        train(_config(tiny_model, out, steps=2, save_every=1, **change), make_env=_toy, resume=True)
    result = train(_config(tiny_model, out, steps=2, save_every=1, eval_every=1, micro_batch_size=2), make_env=_toy, resume=True)
    assert result["steps"] == 2
    assert _steps(out) == [1, 2]


def test_resume_falls_back_when_a_verified_checkpoint_is_refused_at_load(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(_config(tiny_model, out, steps=3, save_every=1), make_env=_toy)
    marker = tmp_path / "pwned"
    torch.save({"step": 3, "optimizer": _Planted(marker)}, out / "checkpoints" / "step-3" / STATE_FILE)
    _rehash(out / "checkpoints" / "step-3")
    (out / "checkpoints" / "step-2" / "model.safetensors").write_bytes(b"not a tensor file")
    _rehash(out / "checkpoints" / "step-2")
    with pytest.warns(UserWarning, match="does not load"):
        result = train(_config(tiny_model, out, steps=3, save_every=1), make_env=_toy, resume=True)
    assert result["steps"] == 3
    assert _steps(out) == [1, 2, 3]  # steps 2 and 3 run again from step-1
    assert not marker.exists()


def test_a_checkpoint_of_another_shape_is_refused(tmp_path: Path) -> None:
    directory = _save(tmp_path / "step-1", step=1)  # moments of a Linear(3, 2)
    other = torch.nn.Linear(2, 3)
    optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(CheckpointError, match=r"shape \(2, 3\), the model's is \(3, 2\)"):
        load_state(directory, optimizer=optimizer, scheduler=scheduler)


def test_resume_restores_the_optimizer_moments(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(_config(tiny_model, out, steps=2, save_every=2), make_env=_toy)
    saved = torch.load(out / "checkpoints" / "step-2" / STATE_FILE, weights_only=True)["optimizer"]["state"]
    state = grpo.setup(_config(tiny_model, out, steps=3), make_env=_toy, resume=True)
    restored = state.optimizer.state_dict()["state"]
    assert state.start_step == 2
    assert any(m["exp_avg"].abs().sum() > 0 for m in saved.values())  # the moments are not all zero
    for index, moments in saved.items():
        assert torch.equal(restored[index]["exp_avg"], moments["exp_avg"])
        assert torch.equal(restored[index]["exp_avg_sq"], moments["exp_avg_sq"])


def test_a_finished_run_resumed_logs_its_final_evaluation_once() -> None:
    train_row = {"step": 3, "loss": 0.1, "step_time_s": 1.0}
    final = {"step": 3, "eval/success_rate": 0.5, "eval/mean_reward": 0.4}
    assert grpo._has_final_eval([train_row, final], 3)
    assert not grpo._has_final_eval([train_row], 3)
    assert not grpo._has_final_eval([final, {**train_row, "step": 4}], 4)


def test_metrics_rows_skip_a_torn_line(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "lo\n')
    log.write({"step": 3})
    assert [r["step"] for r in log.rows()] == [1, 3]
