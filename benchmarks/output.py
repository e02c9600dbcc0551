"""How every benchmark hands back its result: printed as JSON, and written to `--json` if given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], path: Path | None) -> None:
    """Print `result` as JSON; also write it to `path` (parent folders made) when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
