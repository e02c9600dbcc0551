"""Where a sampling step's time goes on this CPU: prefill and decode, per KV cache and dtype.

    python -m cgym.benchmarks.decode_step --model smollm2-135m --batch 32 --prompt 850 --json PATH

Runs one batch-1 prefill of a shared prompt, copies its keys/values to `--batch` rows and times
`--steps` decode steps, for transformers' `DynamicCache` (a `torch.cat` per step) and our
`GrowingLayer` cache, in fp32 and bf16 weights; and a batched prefill of the whole prompt per
dtype. Random token ids: the cost does not depend on which tokens they are.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from cgym.agents.local.kv_cache import growing_cache
from cgym.agents.pretrained import resolve_model
from cgym.benchmarks.output import emit
from transformers import AutoModelForCausalLM, DynamicCache


def decode_ms(model: Any, cache: Any, batch: int, prompt: int, steps: int) -> float:
    """Median milliseconds per decode step after a shared prefill copied to `batch` rows."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt))
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(batch)
        tok = torch.zeros((batch, 1), dtype=torch.long)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def prefill_tokens_per_s(model: Any, batch: int, prompt: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return batch * prompt / (time.perf_counter() - start)


def run(model_name: str, batch: int, prompt: int, steps: int) -> dict[str, Any]:
    path = resolve_model(model_name)
    result: dict[str, Any] = {"model": model_name, "batch": batch, "prompt_tokens": prompt, "steps": steps, "threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        name = str(dtype).removeprefix("torch.")
        result[f"{name}/decode_ms_dynamic_cache"] = decode_ms(model, DynamicCache(config=model.config), batch, prompt, steps)
        result[f"{name}/decode_ms_growing_cache"] = decode_ms(model, growing_cache(model), batch, prompt, steps)
        result[f"{name}/prefill_tokens_per_s"] = prefill_tokens_per_s(model, min(batch, 8), prompt)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=850)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    emit(run(args.model, args.batch, args.prompt, args.steps), args.json)


if __name__ == "__main__":
    main()
