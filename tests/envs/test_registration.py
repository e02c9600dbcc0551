from __future__ import annotations

import gymnasium as gym
import pytest

import envs
from envs.errors import InvalidChoiceError, InvalidEnvKwargError, UnknownEnvError


def test_builtins_are_registered_with_gymnasium() -> None:
    assert "cgym/ApiReport-v0" in envs.registered()
    assert "cgym/ApiReport-v0" in gym.registry


def test_unknown_id_suggests_the_closest() -> None:
    with pytest.raises(UnknownEnvError, match="Did you mean 'cgym/ApiReport-v0'"):
        envs.make("cgym/ApiReprot-v0")


def test_unknown_kwarg_suggests_the_closest() -> None:
    with pytest.raises(InvalidEnvKwargError, match="Did you mean 'difficulty'"):
        envs.make("cgym/ApiReport-v0", dificulty="hard")


@pytest.mark.parametrize(("kwargs", "match"), [({"difficulty": "hrad"}, "'hard'"), ({"split": "tset"}, "'test'")], ids=["difficulty", "split"])
def test_bad_choice_names_the_choices(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidChoiceError, match=match):
        envs.make("cgym/ApiReport-v0", **kwargs)


def test_bad_id_shape_is_refused() -> None:
    with pytest.raises(envs.CgymError, match="namespace/Name-v0"):
        envs.register("no-version", "envs.api_report:ApiReportEnv")


def test_register_a_new_env_and_make_it() -> None:
    envs.register("testorg/Report-v0", "envs.api_report:ApiReportEnv", description="test", difficulty="medium")
    env = envs.make("testorg/Report-v0")
    assert env.unwrapped.difficulty == "medium"


def test_plugins_load_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    from envs import registration

    calls: list[str] = []

    class FakeEntryPoint:
        name = "fake"

        def load(self):
            return lambda: calls.append("registered")

    monkeypatch.setattr(registration, "_plugins_loaded", False)
    monkeypatch.setattr(registration.importlib.metadata, "entry_points", lambda group: [FakeEntryPoint()] if group == "cgym.envs" else [])
    registration.load_plugins()
    registration.load_plugins()  # only once
    assert calls == ["registered"]
