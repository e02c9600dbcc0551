from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import pytest
from cgym.envs.errors import InvalidChoiceError, InvalidEnvKwargError, UnknownEnvError

from cgym import envs


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
        envs.register("no-version", "cgym.envs.api_report:ApiReportEnv")


def test_register_a_new_env_and_make_it() -> None:
    envs.register("testorg/Report-v0", "cgym.envs.api_report:ApiReportEnv", description="test", difficulty="medium")
    env = envs.make("testorg/Report-v0")
    assert env.unwrapped.difficulty == "medium"


def test_plugins_load_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    from cgym.envs import registration

    calls: list[str] = []

    class FakeEntryPoint:
        name = "fake"
        module = "fake_plugin"

        def load(self):
            return lambda: calls.append("registered")

    monkeypatch.setattr(registration, "_plugins_loaded", False)
    monkeypatch.setattr(registration, "_plugins_done", set())
    monkeypatch.setattr(registration.importlib.metadata, "entry_points", lambda group: [FakeEntryPoint()] if group == "cgym.envs" else [])
    registration.load_plugins()
    registration.load_plugins()  # only once
    assert calls == ["registered"]


def _fake_plugin(root: Path, body: str) -> dict[str, str]:
    """An installed-looking plugin (dist-info with a ``cgym.envs`` entry point) under `root`."""
    dist = root / "myorg_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myorg-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[cgym.envs]\nmyorg = myorg_plugin:register_all\n")
    (root / "myorg_plugin.py").write_text(textwrap.dedent(body))
    repo = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(repo)])}


PLUGIN = """
    from cgym import envs  # a plugin that imports envs: loading it from `import cgym.envs` must not recurse


    def register_all():
        envs.register("myorg/Foo-v0", "tests.agents.plugin_env:SumEnv", agents="tests.agents.plugin_env:FAMILY")
"""


@pytest.mark.parametrize(
    ("first", "make"),
    # imported first, the plugin is half-imported when `envs` loads it: the next envs call loads it
    [("import cgym.envs", "gymnasium.make"), ("import myorg_plugin", "cgym.envs.make")],
    ids=["envs-first", "plugin-first"],
)
def test_plugins_load_on_import_envs(tmp_path: Path, first: str, make: str) -> None:
    script = f"""
{first}
import gymnasium, cgym.envs
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.scripted import ScriptedPolicy

env = {make}("myorg/Foo-v0")
results = run_episodes(lambda: gymnasium.make("myorg/Foo-v0"), ScriptedPolicy("oracle"), range(3))
print(type(env.unwrapped).__name__, all(r.success for r in results))
"""
    done = subprocess.run([sys.executable, "-c", script], env=_fake_plugin(tmp_path, PLUGIN), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SumEnv", "True"] and "failed to load" not in done.stderr


def test_scripted_agent_names_are_checked_after_plugins_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from cgym.agents.scripted import Family, ScriptedPolicy
    from cgym.envs import registration

    from tests.agents.plugin_env import oracle

    class PluginEntryPoint:
        name = "names"
        module = "names_plugin"

        def load(self):
            family = Family("plugin", {"oracle": oracle, "count_on_fingers": oracle})
            return lambda: envs.register("myorg/Names-v0", "tests.agents.plugin_env:SumEnv", agents=family)

    monkeypatch.setattr(registration, "_plugins_loaded", False)
    monkeypatch.setattr(registration, "_plugins_done", set())
    monkeypatch.setattr(registration.importlib.metadata, "entry_points", lambda group: [PluginEntryPoint()] if group == "cgym.envs" else [])
    assert ScriptedPolicy("count_on_fingers").name == "scripted:count_on_fingers"
    gym.registry.pop("myorg/Names-v0")


def test_takes_kwarg_reads_the_env_signature() -> None:
    assert envs.registration.takes_kwarg("cgym/ApiReport-v0", "split")
    envs.register("testorg/NoSplit-v0", "tests.agents.plugin_env:SumEnv")
    try:
        assert not envs.registration.takes_kwarg("testorg/NoSplit-v0", "split")
        assert envs.registration.takes_kwarg("testorg/NoSplit-v0", "max_turns")
    finally:
        gym.registry.pop("testorg/NoSplit-v0")
    with pytest.raises(UnknownEnvError):
        envs.registration.takes_kwarg("cgym/Nope-v0", "split")


SELF_REGISTERING = """
    from cgym import envs

    envs.register("plugorg/Sum-v0", "tests.agents.plugin_env:SumEnv", description="Add two numbers.", agents="tests.agents.plugin_env:FAMILY")
"""


def test_a_plugin_works_with_a_bare_gymnasium_through_its_module_prefix(tmp_path: Path) -> None:
    """No entry point and no `import cgym`: Gymnasium's `module:id` imports the plugin, which registers."""
    (tmp_path / "plugorg_envs.py").write_text(textwrap.dedent(SELF_REGISTERING))
    script = """
import sys, gymnasium
env = gymnasium.make("plugorg_envs:plugorg/Sum-v0")
env.reset(seed=0)
print(type(env.unwrapped).__name__, "cgym.envs" in sys.modules)
"""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SumEnv", "True"]


def test_critique_gym_takes_the_module_prefix_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cgym.agents.scripted import family_for

    from cgym.cli import main

    (tmp_path / "plugorg_envs2.py").write_text(textwrap.dedent(SELF_REGISTERING).replace("plugorg/Sum-v0", "plugorg/Sum2-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert type(envs.make("plugorg_envs2:plugorg/Sum2-v0").unwrapped).__name__ == "SumEnv"
        assert family_for("plugorg_envs2:plugorg/Sum2-v0").name == family_for("plugorg/Sum2-v0").name
        assert envs.registered()["plugorg/Sum2-v0"].description == "Add two numbers."
        assert main(["audit", "--env", "plugorg_envs2:plugorg/Sum2-v0", "--episodes", "2"]) == 0
        assert "plugorg/Sum2-v0" in capsys.readouterr().out
    finally:
        gym.registry.pop("plugorg/Sum2-v0", None)
    assert "plugorg/Sum2-v0" not in envs.registered()  # Gymnasium's registry is the one registry
    with pytest.raises(UnknownEnvError, match="cannot import 'no_such_plugin'"):
        envs.make("no_such_plugin:plugorg/Sum-v0")


def test_a_card_reads_entry_point_and_defaults_from_gymnasium() -> None:
    card = envs.registered()["cgym/ApiReport-v0"]
    assert card.entry_point == gym.registry["cgym/ApiReport-v0"].entry_point == "cgym.envs.api_report:ApiReportEnv"
    assert card.defaults == {} and "shop API" in card.description
