"""Options generated from the config dataclasses: each field's type, default, choices and docstring."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from cgym.agents.eval.evaluate import EvalConfig
from cgym.agents.options import SamplingOptions
from cgym.trainer.config import TrainConfig

from cgym.cli import build_parser
from cgym.commands import train_config
from cgym.options import add_config_options, config_kwargs, field_docs


@dataclass(frozen=True)
class Toy:
    """A config with one field of each kind the generator handles."""

    steps: int = 3
    """How many steps."""
    mode: Literal["a", "b"] = "a"
    """Which mode;
    the docstring spans two lines."""
    rate: float = 0.5
    """A rate of 50%."""
    verbose: bool = False
    """Say more."""
    shaping: bool = True
    """Shape the ratio."""
    out: Path = Path("runs")
    names: list[str] = field(default_factory=list)
    """Not an option type without an override."""


def toy_parser(**kw: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Toy, skip=("names",), **kw)  # type: ignore[arg-type]
    return parser


def test_defaults_types_and_flags_come_from_the_dataclass() -> None:
    args = toy_parser().parse_args([])
    assert config_kwargs(args, Toy) == {"steps": 3, "mode": "a", "rate": 0.5, "verbose": False, "shaping": True, "out": Path("runs")}
    args = toy_parser(flags={"rate": "lr"}).parse_args(["--steps", "7", "--mode", "b", "--lr", "0.1", "--verbose", "--no-shaping", "--out", "x"])
    assert Toy(**config_kwargs(args, Toy)) == Toy(steps=7, mode="b", rate=0.1, verbose=True, shaping=False, out=Path("x"))


def test_literal_fields_become_choices() -> None:
    with pytest.raises(SystemExit):
        toy_parser().parse_args(["--mode", "c"])


def test_field_docstrings_are_the_help_on_one_line() -> None:
    assert field_docs(Toy)["mode"] == "Which mode; the docstring spans two lines."
    help_text = " ".join(toy_parser().format_help().split())
    assert "A rate of 50%. (default: 0.5)" in help_text and "Shape the ratio." in help_text


def test_a_field_without_an_option_type_needs_an_override() -> None:
    with pytest.raises(TypeError, match="Toy.names"):
        add_config_options(argparse.ArgumentParser(), Toy)
    parser = argparse.ArgumentParser()
    add_config_options(parser, Toy, types={"names": lambda text: text.split(",")})
    assert parser.parse_args(["--names", "a,b"]).names == ["a", "b"]


@pytest.mark.parametrize("config", [TrainConfig, EvalConfig, SamplingOptions], ids=lambda c: c.__name__)
def test_every_config_field_has_a_docstring(config: type) -> None:
    assert [f.name for f in dataclasses.fields(config) if not field_docs(config).get(f.name)] == []


def _subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_train_defaults_are_train_config_defaults() -> None:
    args = build_parser().parse_args(["train", "--env", "cgym/ApiReport-v0", "--model", "tiny", "--out", "o"])
    assert train_config(args) == TrainConfig(model="tiny", out="o")


def test_a_repeated_env_mixes_envs_by_weight() -> None:
    args = build_parser().parse_args(["train", "--env", "cgym/ApiReport-v0", "--env", "cgym/SqlQuery-v0", "--env-weights", "0.7", "0.3", "--model", "tiny", "--out", "o"])
    config = train_config(args)
    assert (config.env_ids, config.env_probabilities) == (("cgym/ApiReport-v0", "cgym/SqlQuery-v0"), pytest.approx((0.7, 0.3)))


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        pytest.param("train", ["--env", "--env-kwargs", "--model", "--out", "--steps", "--group-size", "--tasks-per-step", "--task-pool", "--lr",
                               "--loss-type", "--scale", "--epsilon-low", "--epsilon-high", "--beta", "--num-iterations", "--micro-batch-size",
                               "--zero-std", "--mask-truncated", "--critique", "--refine-k", "--refine-attempts", "--refine-fail-fraction",
                               "--gamma", "--no-shaping", "--eval-every", "--eval-episodes", "--save-every", "--time-budget", "--lora-r",
                               "--trainable", "--seed", "--resume", "--overwrite", "--credit", "--turn-weight", "--turn-gamma", "--env-weights", "--rollout-groups", "--temperature", "--top-p", "--max-new-tokens"], id="train"),
        pytest.param("eval", ["--env", "--env-kwargs", "--policy", "--episodes", "--split", "--seed", "--samples", "--batch-size",
                              "--self-critique", "--json", "--temperature", "--top-p", "--max-new-tokens"], id="eval"),
        pytest.param("compare", ["--env", "--env-kwargs", "--before", "--after", "--policy", "--episodes", "--seed", "--batch-size",
                                 "--json", "--plot", "--html", "--temperature", "--top-p", "--max-new-tokens"], id="compare"),
    ],
)  # fmt: skip
def test_every_documented_flag_is_still_there(command: str, flags: list[str]) -> None:
    present = {flag for action in _subparser(command)._actions for flag in action.option_strings}
    assert set(flags) - present == set()


def test_eval_and_compare_defaults_are_eval_config_and_sampling_defaults() -> None:
    args = build_parser().parse_args(["eval", "--env", "e", "--policy", "scripted:oracle"])
    defaults = EvalConfig("e")
    assert (args.episodes, args.seed, args.samples, args.batch_size, args.split) == (defaults.episodes, defaults.seed, defaults.samples, defaults.batch_size, "test")
    assert (args.temperature, args.top_p, args.max_new_tokens) == (1.0, 1.0, 256)
