"""How every benchmark hands back its result: printed as JSON, and written to `--json` if given."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], path: Path | None) -> None:
    """Print `result` as JSON; also write it to `path` (parent folders made) when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def machine() -> dict[str, Any]:
    """What a timed figure depends on: the CPU (its name, family and model, cores, native bf16),
    the build of the C kernels (`avx512`, `avx2` or None) and the dtype compute ran in.

    Runs compared at equal wall clock are only comparable on one kind of machine; a result that
    keeps this beside each run can tell when they were not. A virtual machine may name its CPU
    only "AMD EPYC": the family and model tell a Zen 3 (25, 1) from a Zen 4 (25, 17) or a Zen 5 (26, 2)."""
    from cgym.agents.local.kernels import isa
    from cgym.agents.local.precision import compute_dtype, cpu_has_bf16

    info = _cpu_info()
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "family": _number(info.get("cpu family")),
        "model": _number(info.get("model")),
        "cores": os.cpu_count(),
        "bf16": cpu_has_bf16(),
        "kernels": isa(),
        "compute_dtype": str(compute_dtype()).removeprefix("torch."),
    }


def _cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            text = info.read()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines()) if key.strip()}


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None
