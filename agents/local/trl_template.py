"""TRL's tool loop on the project's own models: a response template and, where needed, a tools section.

TRL (`GRPOTrainer(environment_factory=...)`) knows the response formats of a list of chat
templates and refuses the rest, SmolLM2's and the embedded tiny model's among them. Both models
write calls the way critique-gym renders and parses them (Hermes `<tool_call>` blocks in ChatML
turns), so `for_trl` gives the tokenizer that response template, and a template without a tools
section (SmolLM2's drops the schemas) a tools section in the system message, laid out as the
project's own sampler lays it out for that model (`agents.tool_prompt`: the JSON or compact layout
it was trained with)::

    trainer = GRPOTrainer(model, processing_class=for_trl(AutoTokenizer.from_pretrained(model)), ...)
"""

from __future__ import annotations

import json
from typing import Any

from cgym.agents.ledger import end_of_turn_token, template_renders_tools
from cgym.agents.tool_prompt import CALLING, COMPACT_PREAMBLE, JSON_END, JSON_PREAMBLE, ToolLayout, tool_layout
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
        tokenizer.chat_template = _tools_in_system_template(tool_layout(tokenizer)) + tokenizer.chat_template
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


def _tools_in_system_template(layout: ToolLayout) -> str:
    """A Jinja prelude that moves `tools` into the system message in `layout`, as `agents.tool_prompt` writes it."""
    if layout == "json":
        block = f"{json.dumps(JSON_PREAMBLE)} + (tools | map('tojson') | join('\\n')) + {json.dumps(JSON_END + CALLING)}"
    else:
        block = "cgym_compact(tools)"
    return (
        (_COMPACT_MACROS if layout == "compact" else "")
        + "{%- if tools -%}"
        f"{{%- set cgym_block = {block} -%}}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set messages = [{'role': 'system', 'content': (messages[0]['content'] or '') + '\\n\\n' + cgym_block}] + messages[1:] -%}"
        "{%- else -%}{%- set messages = [{'role': 'system', 'content': cgym_block}] + messages -%}{%- endif -%}"
        "{%- endif -%}"
    )


# `tool_prompt.tools_block(tools, "compact")` in Jinja, one macro per Python function there
# (`type_text`, the argument list, `signature`, the block); tests/envs/test_integrations_trl.py
# checks that both write the same text for every built-in tool and the odd schemas.
_COMPACT_MACROS = (
    "{%- macro cgym_type(s, kind) -%}"
    "{%- if 'const' in s -%}{{ s['const'] | tojson }}"
    "{%- elif 'enum' in s -%}{{ s['enum'] | map('tojson') | join('|') }}"
    "{%- elif s.get('anyOf') or s.get('oneOf') -%}"
    "{%- for o in s.get('anyOf') or s.get('oneOf') -%}{{ '' if loop.first else '|' }}{{ cgym_type(o, o.get('type')) }}{%- endfor -%}"
    "{%- elif kind is sequence and kind is not string -%}"
    "{%- for k in kind -%}{{ '' if loop.first else '|' }}{{ cgym_type(s, k) }}{%- endfor -%}"
    "{%- elif kind == 'array' -%}"
    "{%- if s.get('items') is mapping -%}array<{{ cgym_type(s['items'], s['items'].get('type')) }}>{%- else -%}array{%- endif -%}"
    "{%- elif kind == 'object' and s.get('properties') -%}{{ '{' }}{{ cgym_args(s) }}{{ '}' }}"
    "{%- elif kind -%}{{ kind }}"
    "{%- else -%}any{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro cgym_args(s) -%}"
    "{%- set required = s.get('required') or [] -%}"
    "{%- for name, arg in (s.get('properties') or {}).items() -%}"
    "{{ '' if loop.first else ', ' }}{{ name }}{{ '' if name in required else '?' }}: {{ cgym_type(arg, arg.get('type')) }}"
    "{%- endfor -%}"
    "{%- endmacro -%}"
    "{%- macro cgym_signature(tool) -%}"
    "{%- set spec = tool.get('function', tool) -%}"
    "{%- set description = (spec.get('description', '') | string).split() | join(' ') -%}"
    "{{ spec['name'] }}({{ cgym_args(spec.get('parameters') or {}) }}){{ (': ' + description) if description else '' }}"
    "{%- endmacro -%}"
    "{%- macro cgym_compact(tools) -%}"
    f"{{{{ {json.dumps(COMPACT_PREAMBLE)} }}}}"
    "{%- for tool in tools -%}{{ '' if loop.first else '\\n' }}- {{ cgym_signature(tool) }}{%- endfor -%}"
    f"{{{{ {json.dumps(CALLING)} }}}}"
    "{%- endmacro -%}"
)


class UnsupportedTemplateError(CgymError, ValueError):
    """A chat template whose turns `for_trl` cannot describe to TRL."""
