"""LoRA runs (adapter round trip, frozen base, fast paths through the wrapper) and RFT, the
verifier-only baseline (trains on verified successes only)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult, Rubric
from cgym.trainer.grpo import setup, train, train_step

from tests.trainer.test_grpo import ToyEnv, _config, _toy, tiny_model  # noqa: F401  (tiny_model is a fixture)


def _has_a(episode: Episode) -> CheckResult:
    found = "a" in (episode.final_answer or "")
    return CheckResult(found, float(found))


class HasAEnv(ToyEnv):
    """Succeeds when the answer holds an 'a': the untrained tiny model gets both outcomes."""

    rubric = Rubric([Check("has_a", _has_a, 1.0)])

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")


def test_rft_trains_only_on_verified_successes(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import cgym.trainer.grpo as grpo

    seen: dict = {}
    real = grpo._update

    def spy(state, trajs, advantages, step, *rest):
        seen.update(trajs=trajs, advantages=advantages)
        return real(state, trajs, advantages, step, *rest)

    monkeypatch.setattr(grpo, "_update", spy)
    state = setup(_config(tiny_model, tmp_path / "rft", algo="rft", group_size=8, tasks_per_step=4), make_env=lambda split: HasAEnv())
    row = train_step(state, 1)
    assert 0 < row["success_rate"] < 1, "the toy needs both outcomes for this test to say anything"
    assert seen["trajs"] and all(t.success for t in seen["trajs"])
    assert len(seen["trajs"]) == round(row["success_rate"] * 32)
    assert torch.equal(seen["advantages"], torch.ones(len(seen["trajs"])))


def test_rft_refuses_critiques(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rft"):
        _config(tmp_path, tmp_path, algo="rft", critique="step")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_steps_leave_the_base_bit_identical_and_the_adapter_round_trips(tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    from cgym.agents.local.hf import HFPolicy

    config = _config(tiny_model, tmp_path / "lora", lora_r=4, steps=2, save_every=2, learning_rate=1e-2)
    state = setup(config, make_env=_toy)
    base = {n: p.detach().clone() for n, p in state.model.named_parameters() if "lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in state.model.named_parameters() if "lora_" in n}
    assert base and adapter and not any(p.requires_grad for n, p in state.model.named_parameters() if "lora_" not in n)
    for step in (1, 2):
        train_step(state, step)
    assert all(torch.equal(p, base[n]) for n, p in state.model.named_parameters() if "lora_" not in n)
    assert any(not torch.equal(p, adapter[n]) for n, p in state.model.named_parameters() if "lora_" in n)

    from cgym.trainer.grpo import save

    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25]])
    in_memory = _logits(state.model.eval(), ids)
    save(state, 2, tmp_path / "adapter")
    save(state, 2, tmp_path / "merged", merge=True)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    for directory, tol in (("adapter", 0.0), ("merged", 1e-4)):
        loaded = HFPolicy.from_pretrained(f"hf:{tmp_path / directory}", dtype=torch.float32).model
        assert torch.allclose(_logits(loaded, ids), in_memory, atol=tol, rtol=0), directory


def test_lora_run_resumes_exactly_and_saves_a_merged_final(tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    import json

    kwargs = dict(lora_r=4, learning_rate=1e-2, save_every=2)
    train(_config(tiny_model, tmp_path / "straight", steps=3, **kwargs), make_env=_toy)
    train(_config(tiny_model, tmp_path / "resumed", steps=2, **kwargs), make_env=_toy)
    train(_config(tiny_model, tmp_path / "resumed", steps=3, **kwargs), make_env=_toy, resume=True)
    rows = {run: next(json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] == 3) for run in ("straight", "resumed")}
    for key in ("reward_mean", "loss", "grad_norm", "train_tokens"):
        assert rows["straight"][key] == pytest.approx(rows["resumed"][key], rel=1e-5, abs=1e-6), key
    assert not (tmp_path / "straight" / "final" / "adapter_config.json").exists()


def test_a_lora_wrapped_model_keeps_only_the_scored_logit_columns(tiny_model: Path) -> None:  # noqa: F811
    """The loss pass computes the LM head only where a log-prob is wanted, through peft's wrapper too."""
    from cgym.agents.local.lora import with_lora
    from cgym.agents.local.sampling import sequence_logprobs
    from transformers import AutoModelForCausalLM

    widths: list[int] = []
    bare = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    wrapped = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), 4)
    ids = torch.randint(3, 200, (2, 40))
    mask = torch.zeros(2, 39)
    mask[:, -5:] = 1
    for model in (bare, wrapped):
        head = model.get_output_embeddings()
        hook = head.register_forward_hook(lambda module, args, out: widths.append(out.shape[1]))
        sequence_logprobs(model, ids, torch.ones_like(ids), mask=mask, share_prefix=False)
        hook.remove()
    assert widths == [5, 5], f"LM head widths {widths}: full logits are 40 columns"


def test_wrapping_a_model_in_lora_warns_of_nothing(tiny_model: Path) -> None:  # noqa: F811
    """peft reads a property transformers deprecated; its FutureWarning reached every LoRA run's console."""
    import warnings

    from cgym.agents.local.lora import with_lora
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_lora(model, 4)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_a_bf16_lora_update_reads_its_frozen_weights_cast_once(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Under bf16 compute a LoRA update runs inside `frozen_weights_cast` over the frozen base
    layers, and leaves none of them reading a copy afterwards."""
    import cgym.trainer.grpo as grpo
    from cgym.agents.local.precision import DTYPE_ENV

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    covered: list[int] = []
    real = grpo.frozen_weights_cast

    @contextmanager
    def spy(model: torch.nn.Module) -> Iterator[int]:
        with real(model) as layers:
            covered.append(layers)
            yield layers

    monkeypatch.setattr(grpo, "frozen_weights_cast", spy)
    state = setup(_config(tiny_model, tmp_path / "lora", lora_r=4, steps=1, group_size=8, tasks_per_step=4), make_env=lambda split: HasAEnv())
    row = train_step(state, 1)
    assert 0 < row["success_rate"] < 1, "the toy needs both outcomes, so that the update runs"
    assert covered and all(layers > 0 for layers in covered)
    assert not any("forward" in vars(m) for m in state.model.modules() if isinstance(m, torch.nn.Linear))
