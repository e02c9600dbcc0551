"""The embedded tiny model: tokenizer, chat template (tools, tool responses, prefix), loading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from cgym.trainer.tiny import SPECIAL_TOKENS, TOOL_TOKENS, build_tiny, copy_drills, lookup_drills
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

SIZES = dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=1024
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_orders",
            "description": "List a customer's orders.",
            "parameters": {"type": "object", "properties": {"customer_id": {"type": "integer"}}},
        },
    },
    {
        "type": "function",
        "function": {"name": "list_tables", "description": "List tables.", "parameters": {}},
    },
]
CALL = '<tool_call>\n{"name": "get_orders", "arguments": {"customer_id": 7}}\n</tool_call>'
TRANSCRIPT = [
    {"role": "system", "content": "You are a careful API agent."},
    {"role": "user", "content": "Report customer 7's order total as JSON."},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": '{"orders": [{"id": 3, "total": 12.5}]}'},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "list_tables", "arguments": {}}\n</tool_call>',
    },
    {"role": "tool", "content": '["orders"]'},
    {"role": "user", "content": "Answer now."},
    {"role": "assistant", "content": '{"total": 12.5}'},
]


def chat_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Chat-like JSON text, enough for a few hundred BPE merges."""
    rng = random.Random(seed)
    words = (
        "order customer product total status shipped pending report table query name city".split()
    )
    texts = []
    for _ in range(n):
        args = {"customer_id": rng.randint(1, 999), "status": rng.choice(words)}
        call = json.dumps({"name": rng.choice(["get_orders", "list_tables"]), "arguments": args})
        texts.append(
            f"<|im_start|>user\nPlease {' '.join(rng.choices(words, k=6))}.<|im_end|>\n"
            f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
            f'{{"answer": {rng.randint(0, 999)}, "note": "{" ".join(rng.choices(words, k=4))}"}}'
        )
    return texts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"), chat_corpus(), **SIZES)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_loads_with_auto_classes(tiny_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer) <= SIZES["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    with torch.inference_mode():
        logits = model(
            torch.tensor([tokenizer.encode("hello order", add_special_tokens=False)])
        ).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_auto_tokenizer_matches_the_trained_one(tiny_dir: Path, tokenizer) -> None:
    """transformers rebuilds qwen2 tokenizers from vocab + merges: the ids must not change."""
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    text = TRANSCRIPT[3]["content"] + " Café ünïcode 12345 \n\n  spaces " + CALL + "<|im_end|>\n"
    assert (
        tokenizer.encode(text, add_special_tokens=False)
        == raw.encode(text, add_special_tokens=False).ids
    )
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("token", SPECIAL_TOKENS + TOOL_TOKENS)
def test_markers_are_single_tokens(tokenizer, token: str) -> None:
    ids = tokenizer.encode(f"x{token}y", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[1] == token and len(ids) == 3
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert (token in kept) == (token in TOOL_TOKENS)  # tool tags are atomic but not special


def test_build_is_seeded_and_leaves_global_rng_alone(tmp_path: Path, tiny_dir: Path) -> None:
    state = torch.get_rng_state()
    again = build_tiny(tmp_path / "again", chat_corpus(), **SIZES)
    assert torch.equal(state, torch.get_rng_state())
    assert (again / "model.safetensors").read_bytes() == (
        tiny_dir / "model.safetensors"
    ).read_bytes()
    assert (again / "tokenizer.json").read_text() == (tiny_dir / "tokenizer.json").read_text()


def test_template_renders_tools_and_tool_responses(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        TRANSCRIPT[:4], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a careful API agent.\n\n")
    tool_lines = [line for line in system.splitlines() if line.startswith("- ")]
    assert len(tool_lines) == len(TOOLS)
    for line, tool in zip(tool_lines, TOOLS):  # compact signatures: "- name(arg: type, opt?: type): description"
        fn = tool["function"]
        assert line.startswith(f"- {fn['name']}(") and line.endswith(f"): {fn['description']}")
        for pname in fn["parameters"].get("properties", {}):
            assert pname in line
    assert '<tool_call>{"name": ..., "arguments": {...}}</tool_call>' in system
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n"
        '{"orders": [{"id": 3, "total": 12.5}]}'
        "\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_consecutive_tool_messages_share_one_user_turn(tokenizer) -> None:
    messages = [*TRANSCRIPT[:3], {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n"
    )


def test_without_tools_or_system_there_is_no_system_turn(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("tools", [TOOLS, []], ids=["tools", "no-tools"])
@pytest.mark.parametrize("k", range(1, len(TRANSCRIPT)))
def test_prefix_property(tokenizer, tools: list, k: int) -> None:
    def render(messages: list, generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    shorter, longer = render(TRANSCRIPT[:k]), render(TRANSCRIPT[: k + 1])
    assert longer.startswith(shorter) and len(longer) > len(shorter)
    if TRANSCRIPT[k]["role"] == "assistant":
        assert longer.startswith(render(TRANSCRIPT[:k], generation_prompt=True))


def test_copy_drills_repeat_a_run_and_put_the_loss_on_the_repeat(tokenizer) -> None:
    drills = copy_drills(tokenizer, 50, min_len=3, max_len=9, seed=1)
    assert drills == copy_drills(tokenizer, 50, min_len=3, max_len=9, seed=1)
    reserved = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(list(TOOL_TOKENS)))
    sep = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for ids, mask in drills:
        n = (len(ids) - 1) // 2
        assert 3 <= n <= 9 and len(ids) == len(mask) == 2 * n + 1
        assert ids[:n] == ids[n + 1 :] and ids[n] == sep and not reserved & set(ids[:n])
        assert mask == [0] * (n + 1) + [1] * n
    assert len({tuple(ids) for ids, _ in drills}) == 50


def test_digit_drills_copy_runs_of_digits(tokenizer) -> None:
    digits = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    drills = copy_drills(tokenizer, 200, min_len=12, max_len=12, seed=0, digit_share=0.5)
    runs = [ids[:12] for ids, _ in drills]
    digit_runs = [run for run in runs if set(run) <= digits]
    assert 70 <= len(digit_runs) <= 130
    assert all(ids[:12] == ids[13:] for ids, _ in drills)
    assert not [ids for ids, _ in copy_drills(tokenizer, 50, seed=0) if set(ids[:8]) <= digits]


def test_copy_drills_reject_bad_lengths(tokenizer) -> None:
    with pytest.raises(ValueError, match="min_len"):
        copy_drills(tokenizer, 1, min_len=5, max_len=4)
    with pytest.raises(ValueError, match="digit_share"):
        copy_drills(tokenizer, 1, digit_share=1.5)


def _pairs(ids: list[int], tokenizer) -> dict[int, tuple[int, ...]]:
    """Read `{"k": "v", ...}` back at the token level (values may be byte tokens that decode to
    control characters, so not through json)."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    opening, colon, comma, closing = encode('{"'), encode('": "'), encode('", "'), encode('"}')
    assert ids[: len(opening)] == opening and ids[-len(closing) :] == closing
    body, pairs, i = ids[len(opening) : -len(closing)], {}, 0
    while i < len(body):
        key, i = body[i], i + 1
        assert body[i : i + len(colon)] == colon
        i += len(colon)
        end = next((j for j in range(i, len(body)) if body[j : j + len(comma)] == comma), len(body))
        pairs[key], i = tuple(body[i:end]), end + len(comma)
    return pairs


def test_lookup_drills_ask_for_keys_of_the_record_and_put_the_loss_on_the_answer(tokenizer) -> None:
    drills = lookup_drills(tokenizer, 40, keys=(3, 6), asked=(2, 3), seed=2)
    assert drills == lookup_drills(tokenizer, 40, keys=(3, 6), asked=(2, 3), seed=2)
    sep = tokenizer.convert_tokens_to_ids("<|im_start|>")
    reordered = 0
    for ids, mask in drills:
        cut = ids.index(sep)
        assert mask == [0] * (cut + 1) + [1] * (len(ids) - cut - 1)
        record, answer = _pairs(ids[:cut], tokenizer), _pairs(ids[cut + 1 :], tokenizer)
        assert 3 <= len(record) <= 6 and 2 <= len(answer) <= 3
        assert all(record[key] == value and value for key, value in answer.items())
        reordered += list(answer) != [key for key in record if key in answer]
    assert reordered >= 5  # the answer does not follow the record's order: only the key leads there


def test_lookup_drills_reject_bad_ranges(tokenizer) -> None:
    with pytest.raises(ValueError, match="asked"):
        lookup_drills(tokenizer, 1, asked=(0, 2))
    with pytest.raises(ValueError, match="keys"):
        lookup_drills(tokenizer, 1, keys=(4, 3))
