"""The docs' four-line loop must run as written (with the tiny test model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _loop_snippet() -> str:
    text = README.read_text()
    section = text.split("## The four-line loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.mark.slow
def test_readme_loop_runs(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CGYM_MODEL", str(tiny_chat_model))
    namespace: dict = {}
    exec(compile(_loop_snippet(), str(README), "exec"), namespace)
    assert len(namespace["responses"]) == 5
    assert namespace["advantages"].shape == (5,)
