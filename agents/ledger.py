"""Token-exact multi-turn chat: the ledger that local policies keep on each Conversation.

A trajectory is the first prompt's ids, then turn by turn the sampled ids (loss mask 1, their
sampling log-probs) and the ids of what the env said next (mask 0). Sampled ids are never
re-tokenized. Env messages are added as a *text delta* of the chat template: render everything
(with the generation prompt), cut off the rendering of the history up to the last assistant
turn's end-of-turn token, and tokenize only the rest. This needs the template's prefix property
(rendering a shorter history is a prefix of rendering a longer one), which Qwen2.5/Hermes-style
templates have. A template that rewrites history (e.g. drops past reasoning) raises
`LedgerError`; starting a new segment there instead of failing is future work.

Because the assistant's end-of-turn token always closes its turn in the ledger (sampled, or added
unsampled when the turn was cut), decoding `conv.token_ids` gives the template's rendering of the
transcript, as long as the env stores each turn's decoded text unchanged: after a sync it ends
with the generation prompt; right after a turn it stops at that turn's end-of-turn token (the
newline the template puts after it comes with the next env delta).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cgym.agents.base import Conversation, Message
from cgym.agents.tool_prompt import ToolLayout, tool_layout, tools_block
from cgym.envs.errors import CgymError
from transformers import PreTrainedTokenizerBase

END_OF_TURN = "<|im_end|>"


class LedgerError(RuntimeError):
    """The chat template or the message history broke an assumption of the token ledger."""


class NoChatTemplateError(CgymError, ValueError):
    """The tokenizer has no chat template: a base model, or a folder saved without one."""


class ChatEncoder:
    """Keeps `Conversation.token_ids` / `loss_mask` / `logprobs` in step with its messages."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, end_of_turn: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            where = getattr(tokenizer, "name_or_path", "") or "this model"
            raise NoChatTemplateError(
                f"{where} has no chat template: critique-gym talks to chat models (an instruct model, "
                "or a folder saved with its tokenizer's chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn or end_of_turn_token(tokenizer)
        self.end_of_turn_id = _single_token_id(tokenizer, self.end_of_turn)
        self.tools_in_system = not template_renders_tools(tokenizer)
        self.tool_layout = tool_layout(tokenizer)

    # -- rendering -------------------------------------------------------------------------
    def render(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]], generation_prompt: bool
    ) -> str:
        """The chat template's text for `messages` (tools passed only when there are any).

        A template without a tools section (SmolLM2's) would drop the schemas silently, so they
        go into the system message instead, in the layout the model was trained with
        (`agents.tool_prompt`: Hermes/Qwen's JSON schemas, or compact signatures).
        """
        if self.tools_in_system and tools:
            messages, tools = with_tools_in_system(messages, tools, self.tool_layout), ()
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def encode_text(self, text: str) -> list[int]:
        """Tokenize template text as is: no BOS/EOS added, special-token strings stay atomic."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- the ledger ------------------------------------------------------------------------
    def sync(self, conv: Conversation) -> None:
        """Bring the ledger up to date with `conv.messages`, ending with the generation prompt.

        The first call encodes the whole prompt. Later calls expect that the ledger ends with
        a sampled assistant turn, that `conv.messages[conv.synced]` is that turn and that the
        messages after it came from the env; only their template delta is appended (mask 0).
        """
        if not conv.token_ids:
            ids = self.encode_text(self.render(conv.messages, conv.tools, generation_prompt=True))
            _extend(conv, ids)
            conv.prompt_len = len(ids)
        elif len(conv.messages) == conv.synced:
            if conv.token_ids[-1] == self.end_of_turn_id:
                raise LedgerError(
                    "the ledger ends with a sampled turn but no new messages were added: append "
                    "the assistant message (and the env's reply) to conv.messages before acting"
                )
            return  # already synced, ends with the generation prompt
        else:
            _extend(conv, self.encode_text(self._env_delta(conv.messages, conv.tools, conv.synced)))
        conv.synced = len(conv.messages)

    def append_sampled(
        self, conv: Conversation, ids: Sequence[int], logprobs: Sequence[float], *, ended: bool
    ) -> None:
        """Append one sampled assistant turn (mask 1) and close it with the end-of-turn token.

        `ended` says that `ids` end with the end-of-turn token the model sampled; otherwise the
        turn was cut (max new tokens) and the end-of-turn token is added unsampled (mask 0, log-prob
        0.0) so that the template's continuation still lines up.
        """
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} logprobs")
        if ended and (not ids or ids[-1] != self.end_of_turn_id):
            raise ValueError(f"ended=True but the ids do not end with {self.end_of_turn!r}")
        conv.token_ids.extend(ids)
        conv.loss_mask.extend([1] * len(ids))
        conv.logprobs.extend(float(x) for x in logprobs)
        if not ended:
            _extend(conv, [self.end_of_turn_id])

    def encode_demo(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()
    ) -> tuple[list[int], list[int]]:
        """Ledger (ids, loss mask) of a complete scripted conversation, laid out as sampling would.

        Each assistant turn's text (as the template renders it) is tokenized and closed with the
        end-of-turn token, mask 1; everything else is mask 0. Messages after the last assistant
        turn are dropped (they carry no loss).
        """
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise ValueError("a demonstration needs at least one assistant message")
        conv = Conversation(messages=list(messages[: turns[0]]), tools=list(tools))
        for i in turns:
            conv.messages = list(messages[:i])
            self.sync(conv)
            ids = self.encode_text(self._assistant_text(messages[: i + 1], tools)) + [
                self.end_of_turn_id
            ]
            self.append_sampled(conv, ids, [0.0] * len(ids), ended=True)
            conv.messages = list(messages[: i + 1])
        return conv.token_ids, conv.loss_mask

    # -- template arithmetic ---------------------------------------------------------------
    def _env_delta(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]], synced: int
    ) -> str:
        """Text the template adds after the last assistant turn's end-of-turn token."""
        if synced >= len(messages) or messages[synced].get("role") != "assistant":
            got = messages[synced].get("role") if synced < len(messages) else "nothing"
            raise LedgerError(
                f"expected the sampled assistant turn at messages[{synced}], found {got}: the "
                "env must append the assistant message before its own replies"
            )
        if any(m.get("role") == "assistant" for m in messages[synced + 1 :]):
            raise LedgerError("more than one assistant turn was added since the last sync")
        history = self._through_end_of_turn(messages[: synced + 1], tools)
        full = self.render(messages, tools, generation_prompt=True)
        if not full.startswith(history):
            raise LedgerError(
                "the chat template re-rendered earlier turns differently once new messages were "
                "added (no prefix property); this template needs segmented trajectories"
            )
        return full[len(history) :]

    def _assistant_text(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> str:
        """The last (assistant) message as the template renders it, without its end-of-turn."""
        before = self.render(messages[:-1], tools, generation_prompt=True)
        through = self._through_end_of_turn(messages, tools)
        if not through.startswith(before):
            raise LedgerError("the chat template has no prefix property at an assistant turn")
        return through[len(before) : -len(self.end_of_turn)]

    def _through_end_of_turn(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> str:
        """Rendering of `messages` (ending with an assistant turn) cut after its end-of-turn."""
        text = self.render(messages, tools, generation_prompt=False)
        cut = text.rfind(self.end_of_turn)
        if cut < 0:
            raise LedgerError(
                f"the chat template does not close assistant turns with {self.end_of_turn!r}"
            )
        return text[: cut + len(self.end_of_turn)]


def with_tools_in_system(messages: Sequence[Message], tools: Sequence[dict[str, Any]], layout: ToolLayout = "json") -> list[Message]:
    """`messages` with the tools section (`agents.tool_prompt`) appended to the system message (or as a new one)."""
    block = tools_block(tools, layout)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template shows tool schemas at all (a probe schema must change its text)."""
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    tool = {"type": "function", "function": {"name": "cgym_probe_tool", "description": "", "parameters": {"type": "object", "properties": {}}}}
    try:
        with_tool = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that chokes on tools cannot render them either
        return False
    return with_tool != tokenizer.apply_chat_template(probe, tokenize=False)


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str:
    """`<|im_end|>` when the vocabulary has it (ChatML templates), else the tokenizer's eos."""
    if tokenizer.convert_tokens_to_ids(END_OF_TURN) not in (None, tokenizer.unk_token_id):
        return END_OF_TURN
    if tokenizer.eos_token is None:
        raise LedgerError(
            "the tokenizer has neither <|im_end|> nor an eos token to end a turn with"
        )
    return tokenizer.eos_token


def _extend(conv: Conversation, ids: Sequence[int]) -> None:
    """Append non-sampled ids: mask 0, log-prob 0.0."""
    conv.token_ids.extend(ids)
    conv.loss_mask.extend([0] * len(ids))
    conv.logprobs.extend([0.0] * len(ids))


def _single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise LedgerError(f"{token!r} is not a single token for this tokenizer (got ids {ids})")
    return ids[0]
