"""TRL's tool loop on the project's own models: a response template and, where needed, a tools section.

TRL (`GRPOTrainer(environment_factory=...)`) knows the response formats of a list of chat
templates and refuses the rest, SmolLM2's and the embedded tiny model's among them. Both models
write calls the way critique-gym renders and parses them (Hermes `<tool_call>` blocks in ChatML
turns), so `for_trl` gives the tokenizer that response template, and a template without a tools
section (SmolLM2's drops the schemas) a tools section in the system message, laid out as the
project's own sampler lays it out (`agents.tool_prompt`, JSON layout)::

    trainer = GRPOTrainer(model, processing_class=for_trl(AutoTokenizer.from_pretrained(model)), ...)
"""

from __future__ import annotations

import json
from typing import Any

from cgym.agents.ledger import end_of_turn_token, template_renders_tools
from cgym.agents.tool_prompt import CALLING, JSON_END, JSON_PREAMBLE, tool_layout
from cgym.envs.errors import CgymError

CHATML_TURN = "<|im_start|>assistant\n"


def for_trl(tokenizer: Any) -> Any:
    """`tokenizer`, ready for TRL's tool loop: a response template for Hermes calls in ChatML turns,
    and a tools section in the system message if its chat template has none. Returns it.

    Raises `UnsupportedTemplateError` for a template that does not open assistant turns with
    ChatML's `<|im_start|>assistant` (set `response_template` by hand there); a tokenizer that
    already has a response template is left as it is.
    """
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None) is not None:
        return tokenizer
    opened = tokenizer.apply_chat_template([{"role": "user", "content": "u"}], add_generation_prompt=True, tokenize=False)
    end = end_of_turn_token(tokenizer)
    if not opened.endswith(CHATML_TURN) or end != "<|im_end|>":
        raise UnsupportedTemplateError(
            f"for_trl knows chat templates with ChatML turns (<|im_start|>assistant ... <|im_end|>); this one opens the assistant turn with "
            f"{opened[-40:]!r} and ends it with {end!r}. Set tokenizer.response_template for it (see transformers' chat parsing docs)."
        )
    if not template_renders_tools(tokenizer):
        if tool_layout(tokenizer) != "json":
            raise UnsupportedTemplateError(
                f"this model was trained with the {tool_layout(tokenizer)!r} tool layout, which for_trl cannot write into a chat template; "
                "train it in TRL from a model with the json layout, or with `cgym train`"
            )
        tokenizer.chat_template = _tools_in_system_template() + tokenizer.chat_template
    tokenizer.response_template = hermes_response_template()
    return tokenizer


def hermes_response_template() -> dict[str, Any]:
    """transformers' `response_template` for a ChatML assistant turn: text, then `<tool_call>` JSON blocks."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": CHATML_TURN,
        "fields": {
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
        },
    }


def _tools_in_system_template() -> str:
    """A Jinja prelude that moves `tools` into the system message in the JSON layout of `agents.tool_prompt`."""
    return (
        "{%- if tools -%}"
        f"{{%- set cgym_block = {json.dumps(JSON_PREAMBLE)} + (tools | map('tojson') | join('\\n')) + {json.dumps(JSON_END + CALLING)} -%}}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set messages = [{'role': 'system', 'content': (messages[0]['content'] or '') + '\\n\\n' + cgym_block}] + messages[1:] -%}"
        "{%- else -%}{%- set messages = [{'role': 'system', 'content': cgym_block}] + messages -%}{%- endif -%}"
        "{%- endif -%}"
    )


class UnsupportedTemplateError(CgymError, ValueError):
    """A chat template whose turns `for_trl` cannot describe to TRL."""
