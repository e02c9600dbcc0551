"""The embedded tiny model: a byte-level BPE tokenizer trained on env text plus a small Qwen2.

`build_tiny` needs no network and no downloaded weights: it trains the tokenizer on the corpus it
is given (rendered env transcripts), initialises a small `Qwen2ForCausalLM` from a fixed seed and
saves both with `save_pretrained`, so `hf:<dir>` (or the Auto* classes) load it like any model.
The chat template follows the Qwen2.5 / Hermes conventions (`<|im_start|>role\\n...<|im_end|>`,
`<tool_call>` / `<tool_response>` blocks) so demonstrations and real models share one format.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Rendering rules (the ledger in agents/ledger.py relies on them):
# - a first `system` message and/or `tools` become one system turn; tools are listed one JSON
#   object per line inside <tools></tools> (the `function` part of OpenAI schemas, to save context);
# - assistant content is rendered verbatim (OpenAI-style `tool_calls`, if any, follow it as
#   <tool_call> blocks); consecutive `tool` messages share one user turn of <tool_response>s;
# - every turn ends with "<|im_end|>\n", so rendering messages[:k] is a prefix of rendering
#   messages[:k+1] (except between two tool messages of the same run, whose shared turn is only
#   closed by the last one).
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- elif content is mapping -%}{{ content | tojson }}"
    "{%- else -%}{%- for part in content -%}"
    "{{ part.text if part is mapping and part.text is defined else part }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if has_system -%}{{ text(messages[0].content) + '\\n\\n' }}{%- endif -%}"
    '{{ \'Tools (call with <tool_call>{"name": ..., "arguments": {...}}</tool_call>):\\n\' }}'
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{%- set params = fn.parameters if fn.parameters is defined else {} -%}"
    "{%- set required = params.required if params.required is defined else [] -%}"
    "{{ '- ' + fn.name + '(' }}"
    "{%- for pname, spec in (params.properties if params.properties is defined else {}).items() -%}"
    "{{ pname + ('' if pname in required else '?') + ': ' + (spec.type if spec.type is defined else 'any') }}"
    "{%- if not loop.last -%}{{ ', ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ '): ' + (fn.description if fn.description is defined else '') + '\\n' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif has_system -%}"
    "{{ '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and has_system -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + text(message.content) }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set call = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": ' + call.name | tojson + ', \"arguments\": ' }}"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson -}}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# The Qwen2 pre-tokenizer split (digits one by one). transformers loads any `model_type: qwen2`
# checkpoint with its own Qwen2Tokenizer pipeline (NFC + this split + byte-level), so the tokenizer
# is trained with exactly that pipeline: what `build_tiny` saves is what `AutoTokenizer` loads.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_MARKERS = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))


def train_tokenizer(
    corpus: Iterable[str], vocab_size: int, max_positions: int
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (Qwen2 pre-tokenization) and wrap it with the chat template.

    Marker strings are cut out of the training text: they become atomic tokens of their own,
    so no merges are wasted on spelling them.
    """
    reserved = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size < 256 + reserved + 1:
        raise ValueError(f"vocab_size must be at least {256 + reserved + 1}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_strip_markers(corpus), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=max_positions,
    )


def _strip_markers(corpus: Iterable[str]) -> Iterator[str]:
    for text in corpus:
        yield _MARKERS.sub("\n", text)


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_positions: int,
) -> Qwen2Config:
    """A small Qwen2 config sized to the tokenizer (tied embeddings, SwiGLU width ~8/3 * hidden)."""
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and num_heads by "
            f"num_kv_heads ({num_kv_heads})"
        )
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=-(-hidden_size * 8 // 3 // 32) * 32,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
    )


def build_tiny(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    vocab_size: int = 4096,
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Train the tokenizer on `corpus`, initialise a tiny Qwen2 from `seed`, save both to `out_dir`.

    Returns `out_dir` as a Path; `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load it.
    The global torch RNG is left as it was.
    """
    out = Path(out_dir)
    tokenizer = train_tokenizer(corpus, vocab_size, max_positions)
    config = tiny_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_positions=max_positions,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def copy_drills(
    tokenizer: PreTrainedTokenizerFast,
    count: int,
    *,
    min_len: int = 8,
    max_len: int = 48,
    seed: int = 0,
    digit_share: float = 0.0,
) -> list[tuple[list[int], list[int]]]:
    """Synthetic copy drills `(ids, loss mask)`: a run of random ordinary tokens, `<|im_start|>`,
    the same run again, with the loss on the repeat only. A `digit_share` of the runs use the ten
    digit tokens only: there every token repeats, so copying needs the position in the run, not
    just the previous token (ids and dates are where the tiny model slips).

    A freshly initialised tiny model fine-tuned on tool-use demos learns the format within a
    hundred steps, then sits on a plateau where every name, id and date it should copy from the
    context comes from its prior instead (an induction-head plateau). A few hundred steps on
    these drills put copy circuits in place first, after which SFT breaks through in a few hundred
    steps instead of (on 2 CPU cores) not within the budget at all.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if not 0.0 <= digit_share <= 1.0:
        raise ValueError(f"digit_share must be in [0, 1], got {digit_share}")
    reserved = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(list(TOOL_TOKENS)))
    pool = [i for i in range(len(tokenizer)) if i not in reserved]
    sep = tokenizer.convert_tokens_to_ids(IM_START)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    rng = random.Random(seed)
    drills = []
    for _ in range(count):
        run = rng.choices(digits if rng.random() < digit_share else pool, k=rng.randint(min_len, max_len))
        drills.append((run + [sep] + run, [0] * (len(run) + 1) + [1] * len(run)))
    return drills


def lookup_drills(
    tokenizer: PreTrainedTokenizerFast,
    count: int,
    *,
    keys: tuple[int, int] = (3, 7),
    value_len: tuple[int, int] = (1, 3),
    asked: tuple[int, int] = (1, 3),
    seed: int = 0,
) -> list[tuple[list[int], list[int]]]:
    """Synthetic look-up drills `(ids, loss mask)`: a JSON object of random keys and values, then
    `<|im_start|>` and an object repeating a few of its keys, in another order, with their values;
    the loss is on that answer.

    Plain copy drills teach "repeat what followed this token". A report needs more: after
    `"city": "` the value to copy follows the same key in the tool result, and the token right
    before it (` "`) precedes every string value there. A model that only copies by the previous
    token falls back to its prior for every single-token value (it wrote the same city for every
    customer). These drills make the key the only way to the right value.
    """
    for name, (low, high) in {"keys": keys, "value_len": value_len, "asked": asked}.items():
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
    vocab = tokenizer.get_vocab()
    key_pool = sorted(i for t, i in vocab.items() if t.isalpha() and len(t) >= 3)
    value_pool = sorted(i for t, i in vocab.items() if t.lstrip("Ġ").isalnum())
    if len(key_pool) < keys[1]:
        raise ValueError(f"the tokenizer has {len(key_pool)} word tokens, fewer than {keys[1]} keys")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    opening, colon, comma, closing = encode('{"'), encode('": "'), encode('", "'), encode('"}')
    sep = tokenizer.convert_tokens_to_ids(IM_START)
    rng = random.Random(seed)

    def render(pairs: list[tuple[int, list[int]]]) -> list[int]:
        ids = list(opening)
        for n, (key, value) in enumerate(pairs):
            ids += [key, *colon, *value, *(comma if n < len(pairs) - 1 else closing)]
        return ids

    drills = []
    for _ in range(count):
        record = [(key, rng.choices(value_pool, k=rng.randint(*value_len))) for key in rng.sample(key_pool, rng.randint(*keys))]
        answer = render(rng.sample(record, min(len(record), rng.randint(*asked))))
        context = render(record)
        drills.append((context + [sep] + answer, [0] * (len(context) + 1) + [1] * len(answer)))
    return drills
