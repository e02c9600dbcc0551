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
    """What a timed figure depends on: the CPU (model, cores, native bf16) and the dtype compute ran in.

    Runs compared at equal wall clock are only comparable on one kind of machine; a result that
    keeps this beside each run can tell when they were not."""
    from cgym.agents.local.precision import compute_dtype, cpu_has_bf16

    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "bf16": cpu_has_bf16(), "compute_dtype": str(compute_dtype()).removeprefix("torch.")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
