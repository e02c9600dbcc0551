"""What every C kernel computes on fixed inputs, saved with `torch.save` to the path given: run
once per build (`CGYM_KERNEL_ISA`) by `test_builds_agree.py`. Inputs are seeded; outputs are a
flat dict of tensors and lists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from cgym.agents.local import kernels
from cgym.agents.local.attention_backward import attention_backward
from cgym.agents.local.decode_attention import block_attention
from cgym.agents.local.lean_layers import sampling_model
from cgym.agents.local.sampling import sample_batch
from cgym.agents.local.target_logprobs import target_logprobs
from cgym.agents.local.training_ops import fused_training_ops
from cgym.agents.options import SamplingOptions
from transformers import AutoConfig, AutoModelForCausalLM


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sampling(model_dir: Path) -> dict[str, object]:
    """Greedy and sampled turns, and a prefill's logits, of lean bf16 layers with 64-wide heads."""
    config = AutoConfig.from_pretrained(model_dir)
    config.update({"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256, "initializer_range": 0.3})
    torch.manual_seed(0)
    lean = sampling_model(AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval().requires_grad_(False))
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 5, 9, 13, 17, 21, 40, 44, 48], [1, 5, 9, 13, 17, 21, 7]] * 6
    out: dict[str, object] = {}
    for temperature in (0.0, 1.0):
        params = SamplingOptions(temperature=temperature, max_new_tokens=40)
        turns = sample_batch(lean, prompts, params=params, stop_ids={0}, pad_id=0, generator=_seeded(3))
        out[f"turns at T {temperature}"] = [(turn.ids, turn.logprobs) for turn in turns]
    with torch.no_grad():
        logits = lean(input_ids=torch.randint(1, 600, (4, 150), generator=_seeded(1))).logits
    out["prefill logits"] = logits
    out["target logprobs"] = target_logprobs(logits, torch.randint(0, 600, (4, 150), generator=_seeded(4)), 0.7)
    return out


def attention() -> dict[str, object]:
    """The attention kernels forward and back: a shared prefix, causal own keys, a padded row."""
    out: dict[str, object] = {}
    for batch, kv_heads, groups, q_len, prefix in [(2, 3, 3, 37, 20), (1, 2, 3, 90, 301), (2, 1, 2, 150, 17)]:
        torch.manual_seed(batch + q_len)
        q = torch.randn(batch, kv_heads, groups * q_len, 64).to(torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, prefix + q_len, 64).to(torch.bfloat16) for _ in range(2))
        visible = torch.ones(batch, q_len, prefix + q_len, dtype=torch.bool)
        visible[:, :, prefix:] = torch.arange(q_len)[:, None] >= torch.arange(q_len)[None]
        visible[-1, :, prefix : prefix + q_len // 3] = False
        o, lse = block_attention(q, k, v, visible, 0.125)
        grads = attention_backward(q, k, v, torch.randn(o.shape).to(o.dtype), o, lse, visible, 0.125)
        assert grads is not None, "the attention backward kernel answered None"
        out[f"attention {q_len}x{prefix}"] = [o, lse, *grads]
    return out


def training() -> dict[str, object]:
    """A LoRA Llama's loss and gradients through the fused training ops (the training ops'
    tests' model: this script's folder is first on its path)."""
    from test_training_ops import _llama_lora_with_wide_heads

    model = _llama_lora_with_wide_heads()
    ids = torch.randint(0, 40, (3, 50), generator=_seeded(2))
    with fused_training_ops(model):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach(), "gradients": [param.grad for param in model.parameters() if param.grad is not None]}


def loaded_kernels() -> list[str]:
    """The stems of the kernel libraries this process has loaded."""
    return sorted(set(re.findall(r"kernels/(\w+?)_[0-9a-f]{16}\.so", Path("/proc/self/maps").read_text())))


if __name__ == "__main__":
    model_dir, target = Path(sys.argv[1]), sys.argv[2]
    outputs = {**sampling(model_dir), **attention(), **training()}
    torch.save({"isa": kernels.isa(), "kernels": loaded_kernels(), "outputs": outputs}, target)
