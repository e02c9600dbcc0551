"""SFT warm start: demo layout (assistant-only loss mask), loss goes down, output loads and acts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from cgym.agents.base import Conversation
from cgym.agents.ledger import ChatEncoder, LedgerError
from cgym.agents.local.hf import HFPolicy
from cgym.agents.options import SamplingOptions
from cgym.trainer.sft import WARMUP, _schedule, fit, length_buckets, sft
from cgym.trainer.tiny import build_tiny, copy_drills
from transformers import AutoModelForCausalLM, AutoTokenizer

SIZES = dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=1024
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_total",
            "description": "A customer's order total.",
            "parameters": {"type": "object", "properties": {"customer_id": {"type": "integer"}}},
        },
    }
]


def demo(customer: int) -> tuple[list[dict], list[dict]]:
    call = json.dumps({"name": "get_total", "arguments": {"customer_id": customer}})
    return (
        [
            {"role": "system", "content": "Answer with JSON."},
            {"role": "user", "content": f"Total for customer {customer}?"},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": json.dumps({"total": customer * 3})},
            {"role": "assistant", "content": json.dumps({"total": customer * 3})},
        ],
        TOOLS,
    )


DEMOS = [demo(c) for c in (3, 12, 25, 40, 57, 61, 78, 90)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    words = "order customer total answer json tool call report".split()
    corpus = [
        json.dumps(
            {
                "name": "get_total",
                "arguments": {"customer_id": rng.randint(1, 99)},
                "note": rng.choice(words),
            }
        )
        + f" Total for customer {rng.randint(1, 99)}? {' '.join(rng.choices(words, k=5))}"
        for _ in range(300)
    ]
    return build_tiny(tmp_path_factory.mktemp("tiny"), corpus, **SIZES)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def trained(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sft")
    stats = sft(tiny_dir, DEMOS, out, epochs=40, lr=3e-3, batch_size=4, seed=0, progress=False)
    return out, stats


def test_demo_mask_covers_exactly_the_assistant_turns(tokenizer) -> None:
    messages, tools = DEMOS[0]
    ids, mask = ChatEncoder(tokenizer).encode_demo(messages, tools)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    masked = tokenizer.decode(
        [i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
    )
    assert masked == "".join(
        m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"
    )
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) + "\n" == rendered


def test_demo_layout_matches_sampling_layout(tokenizer) -> None:
    """A demo's ledger is the one sync + append_sampled would build while playing the demo."""
    messages, tools = DEMOS[1]
    encoder = ChatEncoder(tokenizer)
    conv = Conversation(messages=messages[:2], tools=tools)
    for i in (2, 4):
        encoder.sync(conv)
        ids = tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [
            encoder.end_of_turn_id
        ]
        encoder.append_sampled(conv, ids, [0.0] * len(ids), ended=True)
        conv.messages = messages[: i + 2]
    assert encoder.encode_demo(messages, tools) == (conv.token_ids, conv.loss_mask)


def test_demo_needs_an_assistant_turn(tokenizer) -> None:
    with pytest.raises(ValueError, match="assistant"):
        ChatEncoder(tokenizer).encode_demo(DEMOS[0][0][:2], TOOLS)


def test_sync_rejects_env_messages_before_the_assistant_turn(tokenizer) -> None:
    encoder = ChatEncoder(tokenizer)
    conv = Conversation(messages=DEMOS[0][0][:2], tools=TOOLS)
    encoder.sync(conv)
    encoder.append_sampled(conv, [encoder.end_of_turn_id], [0.0], ended=True)
    conv.messages.append({"role": "tool", "content": "x"})
    with pytest.raises(LedgerError, match="assistant"):
        encoder.sync(conv)


def test_length_buckets_group_similar_lengths() -> None:
    examples = [([0] * n, [1] * n) for n in (9, 2, 7, 3, 8, 1)]
    assert [[len(ids) for ids, _ in b] for b in length_buckets(examples, 2)] == [
        [1, 2],
        [3, 7],
        [8, 9],
    ]


def test_loss_decreases(trained: tuple[Path, dict]) -> None:
    _, stats = trained
    assert stats["steps"] == 40 * 2
    assert stats["final_loss"] < 0.3 * stats["first_loss"]
    assert 0 < stats["loss_tokens"] < stats["tokens"]


def test_output_loads_and_imitates_the_demos(trained: tuple[Path, dict]) -> None:
    out, _ = trained
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
    policy = HFPolicy.from_pretrained(out, sampling=SamplingOptions(temperature=0.0, max_new_tokens=48))
    messages, tools = DEMOS[2]
    (turn,) = policy.act([Conversation(messages=messages[:2], tools=tools)])
    # Copying the customer id is beyond a few steps of SFT; the call's shape and the stop are not.
    assert not turn.truncated and turn.token_ids[-1] == policy.encoder.end_of_turn_id
    assert turn.text.startswith('<tool_call>\n{"name": "get_total", "arguments": {"customer_id": ')
    assert turn.text.endswith("}}\n</tool_call>")


def test_deterministic_and_time_budget(tiny_dir: Path, tmp_path: Path) -> None:
    runs = [
        sft(tiny_dir, DEMOS[:4], tmp_path / str(i), epochs=3, batch_size=2, progress=False)
        for i in range(2)
    ]
    assert runs[0]["final_loss"] == runs[1]["final_loss"] and runs[0]["steps"] == 6
    short = sft(
        tiny_dir,
        DEMOS[:4],
        tmp_path / "short",
        epochs=50,
        batch_size=2,
        time_budget_s=0.0,
        progress=False,
    )
    assert short["steps"] == 1


def test_schedule_warms_up_then_decays_to_a_tenth() -> None:
    assert _schedule(0.0) == 0.0 and _schedule(WARMUP / 2) == pytest.approx(0.5)
    assert _schedule(WARMUP) == pytest.approx(1.0) and _schedule(1.0) == pytest.approx(0.1)
    after = [_schedule(WARMUP + i / 10 * (1 - WARMUP)) for i in range(11)]
    assert after == sorted(after, reverse=True)


def test_time_budget_drives_the_schedule(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A run cut by the clock has decayed its learning rate, however many steps it planned."""
    clock = iter(range(1000))
    monkeypatch.setattr("cgym.trainer.sft.time.perf_counter", lambda: float(next(clock)))
    seen: list[float] = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    stats = sft(tiny_dir, DEMOS[:4], tmp_path, epochs=100, batch_size=2, lr=1e-3, time_budget_s=5.0, progress=False)
    assert stats["steps"] == len(seen) < 10
    assert seen[-1] == pytest.approx(1e-3 * _schedule(1.0), rel=0.2)


def test_fit_trains_on_ready_examples(tiny_dir: Path, tokenizer, tmp_path: Path) -> None:
    drills = copy_drills(tokenizer, 24, min_len=4, max_len=8, seed=0)
    stats = fit(tiny_dir, drills, tmp_path, epochs=2, batch_size=8, progress=False, label="copy")
    assert stats["steps"] == 6 and stats["loss_tokens"] == 2 * sum(sum(m) for _, m in drills)
    before = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="examples"):
        fit(tiny_dir, [], tmp_path, progress=False)


@pytest.mark.parametrize(("micro", "budget"), [(1, None), (3, None), (8, None), (3, 1)], ids=["rows-1", "rows-3", "whole", "recomputed"])
def test_micro_batches_give_the_whole_batch_gradient(tiny_chat_model, monkeypatch: pytest.MonkeyPatch, micro: int, budget: int | None) -> None:
    """However the batch is split, and with every micro-batch's layers recomputed (a budget each passes)."""
    import cgym.trainer.recompute as recompute
    from cgym.trainer.sft import accumulate_sft_loss, collate, sft_loss
    from transformers import AutoModelForCausalLM

    recomputed: list[int] = []
    if budget is not None:
        real = recompute.recomputed_layers
        monkeypatch.setattr(recompute, "TOKEN_BUDGET", budget)
        monkeypatch.setattr(recompute, "recomputed_layers", lambda model: recomputed.append(1) or real(model))
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    rows = [(list(range(5, 5 + n)), [0] * (n // 2) + [1] * (n - n // 2)) for n in (6, 9, 12, 15, 20, 7)]
    ids, attention, mask = collate(rows, pad_id=0)
    sft_loss(model, ids, attention, mask).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = accumulate_sft_loss(model, ids, attention, mask, micro)
    torch.testing.assert_close(loss, sft_loss(model, ids, attention, mask).detach(), atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], atol=1e-5, rtol=1e-4)
    assert len(recomputed) == (2 if budget is not None else 0)  # 6 rows, 3 a micro-batch


def test_the_prefix_every_demo_shares_runs_once_a_batch_for_the_same_gradient(tiny_chat_model) -> None:
    """Demos that start with one system prompt: it runs once for the batch, not once a
    micro-batch, and the loss and gradients are those of one pass over the whole batch."""
    from cgym.trainer.sft import accumulate_sft_loss, collate, sft_loss
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    system = list(range(40, 70))  # 30 ids every demo starts with, none scored
    rows = [(system + list(range(100 + 10 * i, 100 + 10 * i + n)), [0] * 30 + [0, 0] + [1] * (n - 2)) for i, n in enumerate((6, 9, 12, 15, 20, 7))]
    ids, attention, mask = collate(rows, pad_id=0)
    sft_loss(model, ids, attention, mask).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        loss = accumulate_sft_loss(model, ids, attention, mask, micro_batch_size=2)
    finally:
        hook.remove()
    assert widths.count(30) == 1 and len(widths) == 4  # the head once, then 3 micro-batches after it
    torch.testing.assert_close(loss, sft_loss(model, ids, attention, mask).detach(), atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("width", "rows"), [(100, 4), (500, 4), (900, 2), (1400, 1), (5000, 1)], ids=["short", "easy-compact", "easy-json", "medium", "huge"])
def test_long_demos_get_fewer_rows_per_micro_batch(width: int, rows: int) -> None:
    from cgym.trainer.rollout import rows_within_budget

    assert rows_within_budget(width, 4) == rows


def test_sft_saves_its_layout_with_the_model_and_a_later_sft_keeps_it(tiny_dir: Path, tmp_path: Path) -> None:
    """Given, it is what the model records; not given, the start model's; compact for a model
    that records none (the model as shipped still renders JSON, its own unrecorded default)."""
    from cgym.agents.tool_prompt import recorded_layout, tool_layout

    def layout(name: str) -> str | None:
        return recorded_layout(AutoTokenizer.from_pretrained(tmp_path / name))

    assert recorded_layout(AutoTokenizer.from_pretrained(tiny_dir)) is None and tool_layout(AutoTokenizer.from_pretrained(tiny_dir)) == "json"
    sft(tiny_dir, DEMOS[:2], tmp_path / "json", epochs=1, batch_size=2, progress=False, tool_layout="json")
    sft(tiny_dir, DEMOS[:2], tmp_path / "default", epochs=1, batch_size=2, progress=False)
    sft(tmp_path / "json", DEMOS[:2], tmp_path / "json-again", epochs=1, batch_size=2, progress=False)
    assert (layout("json"), layout("default"), layout("json-again")) == ("json", "compact", "json")
