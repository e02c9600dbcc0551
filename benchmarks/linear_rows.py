"""What a forward's linear layers cost by the number of rows they carry: the decode-time question.

    python -m cgym.benchmarks.linear_rows --json PATH

Times every linear layer of a SmolLM2-135M-shaped model (30 layers of q, k, v, o, gate, up and
down projections, and the 49,152-word LM head) on (rows, hidden) inputs, median of 5, in the
compute dtype, beside the matmul peak of the same run. At few rows a pass reads every weight for
little arithmetic, so its time hardly moves with the rows: sampling that carries few live rows a
pass runs far under the peak however fast each kernel is.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from cgym.benchmarks.cpu_floors import matmul_peak_gflops
from cgym.benchmarks.output import emit, machine

HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30  # SmolLM2-135M
ROWS = (1, 4, 8, 16, 32, 64, 160)


def layer_shapes() -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linear layers."""
    return [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]


def linear_ms(rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Median milliseconds of one forward's linear layers on `rows` rows."""
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=generator, dtype=dtype) * 0.02 for o, i in layer_shapes()] for _ in range(LAYERS)]
    weights.append([torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype) * 0.02])
    inputs = {size: torch.randn(rows, size, generator=generator, dtype=dtype) for size in (HIDDEN, MLP)}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in weights:
                for w in layer:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def run(rows: tuple[int, ...] = ROWS) -> dict[str, Any]:
    from cgym.agents.local.precision import compute_dtype

    dtype = compute_dtype()
    params = LAYERS * sum(o * i for o, i in layer_shapes()) + VOCAB * HIDDEN
    table = []
    for n in rows:
        ms = linear_ms(n, dtype)
        table.append({"rows": n, "ms": round(ms, 1), "gflops": round(2 * params * n / ms / 1e6, 1)})
    return {"machine": machine(), "dtype": str(dtype).removeprefix("torch."), "weights_mb": round(params * torch.finfo(dtype).bits / 8 / 1e6), "matmul_peak_gflops": round(matmul_peak_gflops(dtype), 1), "rows": table}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    emit(run(tuple(args.rows)), args.json)


if __name__ == "__main__":
    main()
