"""Bad configuration raises one error type, `ConfigError`: a `CgymError` (the CLI's one-line exit 2) and a `ValueError`."""

from __future__ import annotations

from typing import Any

import pytest
from cgym.agents.eval.evaluate import EvalConfig
from cgym.agents.options import SamplingOptions
from cgym.envs.errors import CgymError, ConfigError
from cgym.trainer.config import TrainConfig


@pytest.mark.parametrize(
    ("config", "kwargs", "field"),
    [
        pytest.param(TrainConfig, {"model": "tiny", "group_size": 1}, "group_size", id="train-group-of-one"),
        pytest.param(TrainConfig, {"model": "tiny", "critique": "stepp"}, "Did you mean 'step'", id="train-critique-typo"),
        pytest.param(TrainConfig, {"model": "tiny", "loss_type": "dapoo"}, "Did you mean 'dapo'", id="train-loss-type-typo"),
        pytest.param(TrainConfig.from_dict, {"values": {"model": "tiny", "top_p": 1.5}}, "top_p", id="train-top-p"),
        pytest.param(TrainConfig.from_dict, {"values": {"model": "tiny", "max_new_tokens": 0}}, "max_new_tokens", id="train-max-new-tokens"),
        pytest.param(TrainConfig.from_dict, {"values": {"model": "tiny", "temprature": 0.5}}, "Did you mean 'temperature'", id="train-sampling-typo"),
        pytest.param(TrainConfig, {}, "model is required", id="train-no-model"),
        pytest.param(EvalConfig, {"env_id": "cgym/ApiReport-v0", "episodes": 0}, "episodes", id="eval-episodes"),
        pytest.param(EvalConfig, {"env_id": "cgym/ApiReport-v0", "batch_size": 0}, "batch_size", id="eval-batch-size"),
        pytest.param(EvalConfig, {"env_id": "cgym/ApiReport-v0", "seed": -1}, "seed", id="eval-seed"),
        pytest.param(SamplingOptions, {"temperature": -1.0}, "temperature", id="sampling-temperature"),
    ],
)  # fmt: skip
def test_bad_settings_raise_config_error(config: type, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        config(**kwargs)
    assert isinstance(info.value, CgymError) and isinstance(info.value, ValueError)


def test_train_sampling_is_one_sampling_options() -> None:
    config = TrainConfig(model="tiny", sampling=SamplingOptions(temperature=0.5, top_p=0.9), seed=3)
    assert config.sampling == SamplingOptions(temperature=0.5, top_p=0.9, max_new_tokens=256, seed=3)  # the run's seed
    assert TrainConfig(model="tiny").sampling.max_new_tokens == 96  # training turns are short by default
    flat = TrainConfig.from_dict({"model": "tiny", "temperature": 0.5, "top_p": 0.9, "seed": 3})
    assert flat.sampling == SamplingOptions(temperature=0.5, top_p=0.9, max_new_tokens=96, seed=3)
    assert TrainConfig(**flat.to_dict()) == flat  # to_dict nests the settings, and reads back
