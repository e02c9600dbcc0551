"""Building the embedded tiny model is a training step: the policy layer only looks it up."""

from __future__ import annotations

from pathlib import Path

import cgym.agents.pretrained as pretrained
import cgym.trainer.embedded as embedded
import pytest
from cgym.agents.pretrained import ModelFetchError, resolve_model


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the minute-long build with one that writes a marker file; returns the build dirs."""
    seen: list[Path] = []

    def fake_build(out: Path, **kwargs: object) -> Path:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        seen.append(out)
        return out

    monkeypatch.setattr(embedded, "build_embedded_model", fake_build)
    return seen


def test_resolving_tiny_before_it_is_built_names_the_command(cache: Path) -> None:
    with pytest.raises(ModelFetchError, match="cgym tiny"):
        resolve_model("hf:tiny")
    assert not (cache / "models" / "tiny").exists()  # looking it up built nothing


def test_prepare_builds_once_into_the_cache_and_then_resolve_finds_it(cache: Path, builds: list[Path]) -> None:
    embedded.prepare_models("scripted:oracle", None, "smollm2-135m")
    assert builds == []  # no spec named the embedded model
    embedded.prepare_models("hf:tiny")
    embedded.prepare_models("tiny")
    assert len(builds) == 1
    path = Path(resolve_model("tiny"))
    assert path == cache / "models" / "tiny"
    assert (path / "config.json").is_file() and pretrained.is_complete(path)


def test_a_failed_build_leaves_nothing_half_written(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out: Path, **kwargs: object) -> Path:
        out.mkdir(parents=True)
        raise RuntimeError("interrupted")

    monkeypatch.setattr(embedded, "build_embedded_model", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        embedded.ensure_embedded_model()
    assert [p.name for p in (cache / "models").iterdir()] == []
    with pytest.raises(ModelFetchError):
        resolve_model("tiny")


def test_cgym_tiny_without_out_builds_into_the_cache(cache: Path, builds: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    from cgym.cli import main

    assert main(["tiny"]) == 0
    assert len(builds) == 1 and pretrained.is_complete(cache / "models" / "tiny")
    assert "--model tiny" in capsys.readouterr().out
