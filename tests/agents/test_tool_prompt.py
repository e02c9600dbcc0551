"""Tool layouts: the compact one carries every name, type and required flag; the JSON one is unchanged."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cgym.agents.tool_prompt import parse_signature, set_tool_layout, signature, tool_layout, tools_block, type_text

from cgym import envs

BUILT_IN = [
    ("cgym/ApiReport-v0", {"difficulty": "easy"}),
    ("cgym/ApiReport-v0", {"difficulty": "medium"}),
    ("cgym/ApiReport-v0", {"difficulty": "hard"}),
    ("cgym/SqlQuery-v0", {"difficulty": "easy"}),
    ("cgym/SqlQuery-v0", {"difficulty": "hard"}),
]
ODD = {  # what benchmarks ship: enums, arrays of objects, nested objects, unions, nullable and untyped arguments
    "type": "function",
    "function": {
        "name": "book-trip",
        "description": "Book a trip (flights, hotels) for travellers, paying in one currency.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Ghent, BE", 'Lyon "old"']},
                "travellers": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}},
                "budget": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                "nights": {"type": ["integer", "null"]},
                "tags": {"type": "array"},
                "meta": {},
                "mode": {"const": "fast"},
            },
            "required": ["city", "travellers"],
        },
    },
}


def built_in_tools() -> list[dict[str, Any]]:
    tools = []
    for env_id, kwargs in BUILT_IN:
        _, info = envs.make(env_id, **kwargs).reset(seed=0)
        tools += info["tools"]
    return tools


@pytest.mark.parametrize("tool", [*built_in_tools(), ODD], ids=lambda t: t["function"]["name"])
def test_a_signature_carries_every_name_type_and_required_flag(tool: dict[str, Any]) -> None:
    spec = tool["function"]
    parameters = spec.get("parameters", {})
    name, args = parse_signature(signature(tool))
    assert name == spec["name"]
    assert args == {arg: (type_text(schema), arg in parameters.get("required", [])) for arg, schema in parameters.get("properties", {}).items()}
    for arg, schema in parameters.get("properties", {}).items():
        if isinstance(schema.get("type"), str) and schema["type"] != "object" and "enum" not in schema:
            assert args[arg][0].startswith(schema["type"])  # the JSON type's own word (an enum's values show theirs)


def test_type_texts() -> None:
    props = ODD["function"]["parameters"]["properties"]
    assert [type_text(props[k]) for k in props] == [
        '"Oslo"|"Ghent, BE"|"Lyon \\"old\\""', "array<{name: string, age?: integer}>", "number|null", "integer|null", "array", "any", '"fast"',
    ]  # fmt: skip


def test_the_compact_block_is_a_third_of_the_json_one_and_says_how_to_call() -> None:
    tools = built_in_tools()[:5]
    compact, full = tools_block(tools, "compact"), tools_block(tools, "json")
    assert len(compact) < len(full) / 2.5
    assert compact.endswith(full[full.index("\n\nTo call a function") :])  # one instruction for both layouts
    assert all(json.dumps(tool, ensure_ascii=False) in full for tool in tools)
    with pytest.raises(ValueError, match="unknown tool layout"):
        tools_block(tools, "yaml")  # type: ignore[arg-type]


def test_a_tokenizer_keeps_its_layout_through_save_and_load(tmp_path: Any) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    assert tool_layout(tokenizer) == "json"
    set_tool_layout(tokenizer, "compact")
    tokenizer.save_pretrained(tmp_path)
    assert tool_layout(PreTrainedTokenizerFast.from_pretrained(tmp_path)) == "compact"
    with pytest.raises(ValueError, match="unknown tool layout"):
        set_tool_layout(tokenizer, "xml")  # type: ignore[arg-type]
