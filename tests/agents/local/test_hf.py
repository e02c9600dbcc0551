"""The hf: policy: token-exact ledger, batched sampling with padding, seeding, stop handling."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from cgym.agents.base import Conversation, Policy, Turn
from cgym.agents.ledger import ChatEncoder, LedgerError
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.sampling import _top_p_mask, sequence_logprobs, shared_prefix_len
from cgym.agents.options import SamplingOptions
from cgym.trainer.tiny import build_tiny
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
    }
]


def chat_corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "order customer product total status shipped pending report table query".split()
    return [
        json.dumps({"name": "get_orders", "arguments": {"customer_id": rng.randint(1, 999)}})
        + f"<|im_start|>user\n{' '.join(rng.choices(words, k=8))}<|im_end|>\n"
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"), chat_corpus(), **SIZES)


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


def new_conversation(user: str = "Report customer 7's orders.") -> Conversation:
    return Conversation(
        messages=[
            {"role": "system", "content": "You are an API agent."},
            {"role": "user", "content": user},
        ],
        tools=TOOLS,
    )


def play(policy: HFPolicy, convs: list[Conversation], turns: int) -> list[list[Turn]]:
    """Act `turns` times; after each turn the 'env' records it and answers with a tool message."""
    history: list[list[Turn]] = [[] for _ in convs]
    for t in range(turns):
        for conv, turn, past in zip(convs, policy.act(convs), history, strict=True):
            past.append(turn)
            conv.messages.append({"role": "assistant", "content": turn.text})
            if t + 1 < turns:
                conv.messages.append(
                    {"role": "tool", "content": json.dumps({"turn": t, "rows": [1, 2]})}
                )
    return history


def forward_logprobs(model, conv: Conversation, temperature: float = 1.0) -> torch.Tensor:
    """Training-style log-probs of every ledger token (index i: token i given the ones before)."""
    ids = torch.tensor([conv.token_ids])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)[0]
    return torch.cat([torch.zeros(1), lp])


def assert_ledger_reproduced(model, conv: Conversation, temperature: float = 1.0) -> None:
    assert len(conv.token_ids) == len(conv.loss_mask) == len(conv.logprobs)
    mask = torch.tensor(conv.loss_mask, dtype=torch.bool)
    assert mask.any()
    stored = torch.tensor(conv.logprobs)
    assert (stored[~mask] == 0).all()
    recomputed = forward_logprobs(model, conv, temperature)
    torch.testing.assert_close(recomputed[mask], stored[mask], atol=1e-4, rtol=0)


def test_is_a_policy(model, tokenizer) -> None:
    assert isinstance(HFPolicy(model, tokenizer), Policy)


def test_three_turn_episode_is_token_exact(model, tokenizer) -> None:
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=24, seed=0))
    conv = new_conversation()
    (turns,) = play(policy, [conv], turns=3)

    assert_ledger_reproduced(model, conv)
    assert conv.prompt_len > 0 and not any(conv.loss_mask[: conv.prompt_len])
    sampled = [i for i, m in zip(conv.token_ids, conv.loss_mask, strict=True) if m]
    assert sampled == [i for turn in turns for i in turn.token_ids]
    # The ledger decodes to the template's rendering; it stops at the last <|im_end|>, the
    # template's newline after it arrives with the next env delta.
    text = tokenizer.decode(conv.token_ids, skip_special_tokens=False)
    rendered = tokenizer.apply_chat_template(conv.messages, tools=TOOLS, tokenize=False)
    assert text + "\n" == rendered
    conv.messages.append({"role": "user", "content": "Go on."})
    policy.encoder.sync(conv)
    assert tokenizer.decode(
        conv.token_ids, skip_special_tokens=False
    ) == tokenizer.apply_chat_template(
        conv.messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


def test_sampled_ids_are_never_retokenized(model, tokenizer) -> None:
    """The env stores decoded text; the ledger keeps the sampled ids, whatever they re-encode to."""
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=32, seed=3))
    conv = new_conversation()
    (turn,) = policy.act([conv])
    ledger = list(conv.token_ids)
    conv.messages.append({"role": "assistant", "content": turn.text})
    conv.messages.append({"role": "tool", "content": "ok"})
    policy.encoder.sync(conv)
    assert conv.token_ids[: len(ledger)] == ledger
    assert (
        tuple(ledger[-len(turn.token_ids) - (1 if turn.truncated else 0) :][: len(turn.token_ids)])
        == turn.token_ids
    )


def test_batched_act_matches_forward_pass(model, tokenizer) -> None:
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=20, seed=1))
    convs = [new_conversation("Orders? " * n) for n in (1, 6, 15)]
    assert len({len(policy.encoder.render(c.messages, TOOLS, True)) for c in convs}) == 3
    play(policy, convs, turns=2)
    for conv in convs:
        assert_ledger_reproduced(model, conv)


def test_sequence_logprobs_is_padding_invariant(model) -> None:
    rows = [[5, 9, 17, 33, 2], [7, 8, 9]]
    single = [
        sequence_logprobs(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0]
        for r in rows
    ]
    for side in ("left", "right"):
        ids = torch.zeros(2, 5, dtype=torch.long)
        mask = torch.zeros(2, 5, dtype=torch.long)
        for b, r in enumerate(rows):
            span = slice(5 - len(r), 5) if side == "left" else slice(0, len(r))
            ids[b, span] = torch.tensor(r)
            mask[b, span] = 1
        batched = sequence_logprobs(model, ids, mask)
        assert batched.shape == (2, 4)
        torch.testing.assert_close(batched[0], single[0], atol=1e-5, rtol=0)
        short = batched[1, 2:] if side == "left" else batched[1, :2]
        torch.testing.assert_close(short, single[1], atol=1e-5, rtol=0)


def shared_prompt_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows with a 24-token common prefix, and a loss mask on some later columns."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 200, (24,), generator=gen).tolist()
    rows = [prefix + torch.randint(3, 200, (n,), generator=gen).tolist() for n in (9, 4, 13)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), width - 1)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        attention[b, : len(r)] = 1
        mask[b, len(r) - 4 : len(r) - 1] = 1  # a few targets near each row's end
    mask[0, 10] = 1  # and one inside the shared prefix
    return ids, attention, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["t1", "t0.7"])
def test_shared_prefix_and_masked_head_match_the_plain_pass(model, temperature: float) -> None:
    ids, attention, mask = shared_prompt_batch()
    assert shared_prefix_len(ids, attention) == 24
    plain = sequence_logprobs(model, ids, attention, temperature, share_prefix=False)
    shared = sequence_logprobs(model, ids, attention, temperature)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    masked = sequence_logprobs(model, ids, attention, temperature, mask=mask)
    wanted = mask.bool()
    torch.testing.assert_close(masked[wanted], plain[wanted], atol=1e-5, rtol=0)
    assert (masked[:, ~wanted.any(0)] == 0).all()


def test_shared_prefix_gradients_match(tiny_dir: Path) -> None:
    ids, attention, mask = shared_prompt_batch()
    grads = []
    for kwargs in ({"share_prefix": False}, {"mask": mask}):
        net = AutoModelForCausalLM.from_pretrained(tiny_dir)
        (sequence_logprobs(net, ids, attention, **kwargs) * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_no_shared_prefix_with_left_padding_or_one_row() -> None:
    ids = torch.tensor([[0, 5, 6, 7], [4, 5, 6, 7]])
    assert shared_prefix_len(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])) == 0
    assert shared_prefix_len(ids[1:], torch.ones(1, 4, dtype=torch.long)) == 0
    assert shared_prefix_len(ids[[1, 1]], torch.ones(2, 4, dtype=torch.long)) == 3


def test_same_seed_same_turns(model, tokenizer) -> None:
    def run(seed: int) -> list[list[Turn]]:
        policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=16, seed=seed))
        return play(policy, [new_conversation("a"), new_conversation("b b b")], turns=2)

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "t0.7"])
def test_temperature_logprobs(model, tokenizer, temperature: float) -> None:
    """Greedy stores temperature-1 log-probs; otherwise those of logits / temperature."""
    convs = [new_conversation(), new_conversation("x")]
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(temperature=temperature, max_new_tokens=12, seed=0))
    turns = policy.act(convs)
    for conv in convs:
        assert_ledger_reproduced(model, conv, temperature if temperature > 0 else 1.0)
    if temperature == 0:
        again = HFPolicy(model, tokenizer, sampling=SamplingOptions(temperature=0, max_new_tokens=12, seed=99)).act(
            [new_conversation(), new_conversation("x")]
        )
        assert again == turns


def test_top_p_mask_keeps_the_nucleus() -> None:
    logp = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.97, 0.01, 0.01, 0.01]]).log()
    kept = torch.isfinite(_top_p_mask(logp, 0.7))
    assert kept.tolist() == [[False, True, False, True], [True, False, False, False]]


def test_top_p_sampling_stays_in_the_nucleus(model, tokenizer) -> None:
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(top_p=1e-6, max_new_tokens=8, seed=0))
    greedy = HFPolicy(model, tokenizer, sampling=SamplingOptions(temperature=0.0, max_new_tokens=8))
    # A nucleus smaller than any token's mass holds only the top token: sampling becomes greedy.
    assert (
        policy.act([new_conversation()])[0].token_ids
        == greedy.act([new_conversation()])[0].token_ids
    )


@contextmanager
def biased(model, token_id: int, bias: float) -> Iterator[None]:
    """Add `bias` to one token's logit, to make a random model stop now and then."""

    def hook(module, inputs, output):
        output[..., token_id] += bias
        return output

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_stops_at_end_of_turn_or_max_new_tokens(model, tokenizer) -> None:
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=6, seed=0))
    convs = [new_conversation(str(i)) for i in range(12)]
    with biased(model, eot, 5.0):
        turns = policy.act(convs)
        for conv, turn in zip(convs, turns, strict=True):
            assert conv.token_ids[-1] == eot
            assert conv.loss_mask[-1] == (0 if turn.truncated else 1)
            assert (len(turn.token_ids) == 6) if turn.truncated else (turn.token_ids[-1] == eot)
            assert eot not in turn.token_ids[:-1]
            assert turn.text == tokenizer.decode(
                [i for i in turn.token_ids if i != eot], skip_special_tokens=False
            )
            assert_ledger_reproduced(model, conv)
    assert {t.truncated for t in turns} == {True, False}


def test_other_eos_is_replaced_by_end_of_turn(model, tokenizer) -> None:
    eot, other = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eot, other]
    try:
        policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=8, seed=0))
        conv = new_conversation()
        with biased(model, other, 50.0):
            (turn,) = policy.act([conv])
    finally:
        model.generation_config.eos_token_id = saved
    assert turn.token_ids == () and turn.text == "" and not turn.truncated
    assert conv.token_ids[-1] == eot and conv.loss_mask[-1] == 0


def test_acting_twice_without_recording_the_turn_fails(model, tokenizer) -> None:
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=4, seed=0))
    conv = new_conversation()
    policy.act([conv])
    with pytest.raises(LedgerError, match="append the assistant message"):
        policy.act([conv])


def test_template_without_prefix_property_is_detected(tokenizer) -> None:
    """A template that re-renders history differently (here: a message count up front) cannot be
    extended by a delta; the ledger refuses instead of splicing."""
    counting = copy.copy(tokenizer)
    counting.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    encoder = ChatEncoder(counting)
    conv = new_conversation()
    encoder.sync(conv)
    encoder.append_sampled(conv, [encoder.end_of_turn_id], [0.0], ended=True)
    conv.messages += [{"role": "assistant", "content": ""}, {"role": "tool", "content": "x"}]
    with pytest.raises(LedgerError, match="prefix"):
        encoder.sync(conv)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"top_p": 0.0}, {"max_new_tokens": 0}],
    ids=["temperature", "top_p", "max_new"],
)
def test_bad_sampling_options(model, tokenizer, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        HFPolicy(model, tokenizer, sampling=SamplingOptions(**kwargs))


def test_from_pretrained(tiny_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(tiny_dir, sampling=SamplingOptions(max_new_tokens=3, seed=0))
    assert policy.name == f"hf:{tiny_dir}"
    assert policy.model.dtype == torch.float32
    assert len(policy.act([new_conversation()])) == 1


def test_from_pretrained_loads_in_the_compute_dtype(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy that only samples holds the weights once, in the dtype it samples in; a trainer
    asks for float32 master weights and samples from a copy."""
    from cgym.agents.local.precision import DTYPE_ENV

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    policy = HFPolicy.from_pretrained(tiny_dir, sampling=SamplingOptions(max_new_tokens=3, seed=0))
    assert policy.model.dtype == torch.bfloat16
    assert policy.sampling_weights.get() is policy.model
    assert len(policy.act([new_conversation()])) == 1
    master = HFPolicy.from_pretrained(tiny_dir, dtype=torch.float32, sampling=SamplingOptions(max_new_tokens=3, seed=0))
    assert master.model.dtype == torch.float32 and master.sampling_weights.get().dtype == torch.bfloat16


def _prefixed_prompts(tokenizer, n: int = 4) -> list[list[int]]:
    system = tokenizer.encode("<|im_start|>system\nYou are an API agent. " + "Report every order. " * 6 + "<|im_end|>\n", add_special_tokens=False)
    return [system + tokenizer.encode(f"<|im_start|>user\ncustomer {7 * i + 1}<|im_end|>\n" * (1 + i % 2), add_special_tokens=False) for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_shared_prefix_sampling_matches_unshared(model, tokenizer, temperature: float) -> None:
    from cgym.agents.local.kv_cache import PREFIX_ATTENTION, PrefixCache
    from cgym.agents.local.sampling import common_prefix_len, sample_batch

    prompts = _prefixed_prompts(tokenizer)
    assert common_prefix_len(prompts) >= 16
    params = SamplingOptions(temperature=temperature, max_new_tokens=12)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def run(**kw):
        return sample_batch(model, prompts, params=params, stop_ids={end}, pad_id=0, generator=torch.Generator().manual_seed(5), **kw)

    plain, shared, cache = run(share_prefix=False), run(), PrefixCache()
    assert model.config._attn_implementation == PREFIX_ATTENTION  # the prefix was served from one copy
    assert [s.ids for s in shared] == [s.ids for s in plain]
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    first = run(prefix_cache=cache)
    assert cache.entry is not None and len(cache.entry.ids) == common_prefix_len(prompts)
    assert cache.lookup(model, prompts[0]) == len(cache.entry.ids)
    again = run(prefix_cache=cache)  # served from the stored prefix
    assert [s.ids for s in again] == [s.ids for s in first] == [s.ids for s in plain]


@pytest.mark.parametrize("share_prefix", [True, False], ids=["served-prefix", "no-prefix"])
def test_rows_with_the_same_prompt_are_prefilled_once(model, tokenizer, share_prefix: bool) -> None:
    """A GRPO group's first turn is one prompt several times: it runs once and every copy
    decodes from it, as it would alone."""
    from cgym.agents.local.sampling import sample_batch

    a, b = _prefixed_prompts(tokenizer, 2)
    params = SamplingOptions(temperature=0.0, max_new_tokens=10)

    def run(prompts: list[list[int]]) -> tuple[list, list[tuple[int, int]]]:
        shapes: list[tuple[int, int]] = []
        hook = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        try:
            return sample_batch(model, prompts, params=params, stop_ids=set(), pad_id=0, share_prefix=share_prefix, draft_tokens=0), shapes
        finally:
            hook.remove()

    (alone_a, alone_b), _ = run([a, b])
    copies, shapes = run([a, b, a, a])
    assert [s.ids for s in copies] == [alone_a.ids, alone_b.ids, alone_a.ids, alone_a.ids]
    for got, want in zip(copies, [alone_a, alone_b, alone_a, alone_a], strict=True):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
    prefills = [shape for shape in shapes if shape[1] > 1]
    assert prefills and all(rows <= 2 for rows, _ in prefills)  # never the 4 rows
    assert (4, 1) in shapes  # the copies decode as rows of their own


@pytest.mark.parametrize("share_prefix", [True, False], ids=["served-prefix", "no-prefix"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_prefill_in_pieces_matches_one_piece(model, tokenizer, temperature: float, share_prefix: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import cgym.agents.local.sampling as sampling

    prompts = _prefixed_prompts(tokenizer)  # rows of different lengths: left padding in the pieces
    params = SamplingOptions(temperature=temperature, max_new_tokens=12)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def run() -> list[sampling.Sample]:
        return sampling.sample_batch(model, prompts, params=params, stop_ids={end}, pad_id=0, generator=torch.Generator().manual_seed(5), share_prefix=share_prefix)

    whole = run()
    widths: list[int] = []
    forward = sampling._next_logits
    monkeypatch.setattr(sampling, "_next_logits", lambda m, ids, *a, **kw: widths.append(ids.shape[1]) or forward(m, ids, *a, **kw))
    monkeypatch.setattr(sampling, "PREFILL_PIECE", 5)
    pieces = run()

    assert widths.count(5) >= 2  # the prefill did run in pieces (after the shared prefix's own forward)
    assert [s.ids for s in pieces] == [s.ids for s in whole]
    for a, b in zip(pieces, whole, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_prefix_cache_is_invalidated_by_a_weight_update(tiny_dir: Path) -> None:
    from cgym.agents.local.kv_cache import PrefixCache

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(max_new_tokens=4, seed=0))
    policy.act([new_conversation()])
    prompt = new_conversation()
    policy.encoder.sync(prompt)
    assert isinstance(policy.prefix_cache, PrefixCache) and policy.prefix_cache.lookup(model, prompt.token_ids) > 0
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)  # what an optimizer step does
    assert policy.prefix_cache.lookup(model, prompt.token_ids) == 0


def test_prefill_hands_the_lm_head_a_contiguous_input(model, tokenizer) -> None:
    """A strided (B, 1, D) slice made the LM head's matmul copy its weight once per row (2.3 s a
    32-row prefill with SmolLM2 in bf16); the sampler asks for the last column by index."""
    from cgym.agents.local.sampling import sample_batch

    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        sample_batch(model, _prefixed_prompts(tokenizer), params=SamplingOptions(temperature=0.0, max_new_tokens=3), stop_ids=set(), pad_id=0, share_prefix=False)
    finally:
        hook.remove()
    assert seen and seen[0][0][:2] == (4, 1)  # the prefill: 4 rows, one column each
    assert all(contiguous for _, contiguous in seen)


def test_a_shared_head_gives_the_plain_log_probs_and_gradients(tiny_dir: Path) -> None:
    """The batch's common prefix run once, its gradients gathered over micro-batches and sent
    through its pass once, equals every micro-batch running the whole rows."""
    from cgym.agents.local.sampling import shared_head

    ids, attention, mask = shared_prompt_batch()
    mask[0, 10] = 0  # nothing scored inside the head
    results = []
    for use_head in (False, True):
        net = AutoModelForCausalLM.from_pretrained(tiny_dir)
        head = shared_head(net, ids[0, :20]) if use_head else None
        values = []
        for rows in ([0, 1], [2]):  # two micro-batches
            lp = sequence_logprobs(net, ids[rows], attention[rows], mask=mask[rows], head=head, share_prefix=False)
            (lp * mask[rows]).sum().backward()
            values.append(lp.detach() * mask[rows])
        if head is not None:
            head.backward()
        results.append((torch.cat(values), torch.cat([p.grad.flatten() for p in net.parameters()])))
    (plain_lp, plain_grad), (head_lp, head_grad) = results
    assert plain_grad.abs().sum() > 0
    torch.testing.assert_close(head_lp, plain_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(head_grad, plain_grad, atol=1e-5, rtol=1e-4)


def group_batch(shared: int = 60) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows sharing their first `shared` ids (a head and a group's prompt), scored
    inside the shared part, on its last column (whose target is the first id the rows differ
    at) and near each row's end."""
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 200, (shared,), generator=gen).tolist()
    rows = [prefix + [3 + b] + torch.randint(3, 200, (n,), generator=gen).tolist() for b, n in enumerate((9, 4, 13))]
    width = max(len(r) for r in rows)
    ids, attention, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width - 1)
    for b, r in enumerate(rows):
        ids[b, : len(r)], attention[b, : len(r)] = torch.tensor(r), 1
        mask[b, len(r) - 4 : len(r) - 1] = 1
    mask[:, [30, 41, shared - 1]] = 1
    mask[1, 35] = 1  # one row only
    return ids, attention, mask


@pytest.mark.parametrize("micro", [[[0, 1, 2]], [[0, 2], [1]]], ids=["one-micro-batch", "two"])
def test_columns_a_micro_batch_shares_past_the_head_run_once_with_the_plain_results(tiny_dir: Path, micro: list[list[int]]) -> None:
    """Past the batch's head, the columns every row of a micro-batch shares (a GRPO group's
    task prompt and its alike turns) run once, batch 1; log-probs and gradients are those of
    running every row whole."""
    from cgym.agents.local.sampling import shared_head

    ids, attention, mask = group_batch()
    results, widths = [], []
    for use_head in (False, True):
        net = AutoModelForCausalLM.from_pretrained(tiny_dir)
        head = shared_head(net, ids[0, :20]) if use_head else None
        values = []
        with counted_forwards(net) as seen:
            for rows in micro:
                lp = sequence_logprobs(net, ids[rows], attention[rows], mask=mask[rows], head=head, share_prefix=use_head)
                (lp * mask[rows]).sum().backward()
                values.append(lp.detach() * mask[rows])
        widths.append(seen)
        if head is not None:
            head.backward()
        order = torch.tensor([row for rows in micro for row in rows])
        results.append((torch.cat(values)[order.argsort()], torch.cat([p.grad.flatten() for p in net.parameters()])))
    (plain_lp, plain_grad), (lp, grad) = results
    assert plain_grad.abs().sum() > 0 and bool((lp[mask.bool()] != 0).all())
    torch.testing.assert_close(lp, plain_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-4)
    past_head = [w for w in widths[1] if w == 40]  # the 40 shared columns after the 20 of the head
    assert len(past_head) == sum(len(rows) > 1 for rows in micro)  # once per micro-batch of several rows


def test_a_shared_head_refuses_rows_it_does_not_lead_or_targets_inside_it(model) -> None:
    from cgym.agents.local.sampling import shared_head

    ids, attention, mask = shared_prompt_batch()
    head = shared_head(model, ids[0, :20])
    with pytest.raises(ValueError, match="targets inside"):
        sequence_logprobs(model, ids, attention, mask=mask, head=head)  # mask[0, 10] is inside
    other = ids.clone()
    other[1, 3] += 1
    mask[0, 10] = 0
    with pytest.raises(ValueError, match="start with"):
        sequence_logprobs(model, other, attention, mask=mask, head=head)


@contextmanager
def counted_forwards(model) -> Iterator[list[int]]:
    """The width of every forward call's input ids."""
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        yield widths
    finally:
        hook.remove()


@pytest.mark.parametrize("share_prefix", [False, True], ids=["own-prefix", "shared-prefix"])
def test_prompt_lookup_drafts_keep_the_greedy_ids(model, tokenizer, share_prefix: bool) -> None:
    """Greedy rows draft ids from their own context and verify them in one forward: the same
    ids and log-probs as one id per forward, in fewer forwards (the tiny model repeats itself).
    Three rows draft `LONG_DRAFT_TOKENS` ids a step, repeating a loop they are in."""
    from cgym.agents.local.lookup import LONG_DRAFT_TOKENS
    from cgym.agents.local.sampling import LOOKUP_TOKENS, sample_batch

    prompts = _prefixed_prompts(tokenizer, n=3)
    params = SamplingOptions(temperature=0.0, max_new_tokens=40)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def run(draft_tokens: int):
        with counted_forwards(model) as widths:
            samples = sample_batch(model, prompts, params=params, stop_ids={end}, pad_id=0, share_prefix=share_prefix, draft_tokens=draft_tokens)
        return samples, widths

    (plain, plain_widths), (drafted, drafted_widths) = run(0), run(LOOKUP_TOKENS)
    assert [s.ids for s in drafted] == [s.ids for s in plain]
    assert [s.stopped for s in drafted] == [s.stopped for s in plain]
    for a, b in zip(drafted, plain, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert LONG_DRAFT_TOKENS + 1 in drafted_widths  # drafts were checked...
    assert len(drafted_widths) < len(plain_widths)  # ... and kept: fewer forwards


def test_sampled_rows_check_drafts_and_keep_the_models_logprobs(model, tokenizer) -> None:
    """Sampled rows draft too (`accept_drafts` keeps their distribution): a seed still gives the
    same ids, and each id's log-prob is the model's for it after the ids before it."""
    from cgym.agents.local.sampling import LOOKUP_TOKENS, sample_batch

    prompts = _prefixed_prompts(tokenizer, n=3)
    params = SamplingOptions(temperature=0.15, max_new_tokens=40)  # cool enough that the tiny model repeats itself, not always
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def run():
        with counted_forwards(model) as widths:
            samples = sample_batch(model, prompts, params=params, stop_ids={end}, pad_id=0, generator=torch.Generator().manual_seed(3))
        return samples, widths

    (first, widths), (again, _) = run(), run()
    assert LOOKUP_TOKENS + 1 in widths and len(widths) < params.max_new_tokens  # drafts were checked and some kept
    assert [s.ids for s in first] == [s.ids for s in again]
    for prompt, sample in zip(prompts, first, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + sample.ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float() / params.temperature, -1).gather(-1, torch.tensor(sample.ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_a_conversation_past_max_context_gets_an_empty_cut_turn(model, tokenizer) -> None:
    short, long = new_conversation(), new_conversation("Report the orders. " * 40)
    encoder = ChatEncoder(tokenizer)
    for conv in (copy.deepcopy(short), copy.deepcopy(long)):
        encoder.sync(conv)
    limit = len(encoder.encode_text(encoder.render(long.messages, TOOLS, generation_prompt=True)))
    policy = HFPolicy(model, tokenizer, max_context=None, sampling=SamplingOptions(max_new_tokens=6, seed=0))
    play(policy, [short, long], turns=1)  # both sampled once; both have turn-cache entries
    assert id(long) in policy.turn_cache.entries
    alone = copy.deepcopy(short)
    short.messages.append({"role": "user", "content": "Go on."})
    long.messages.append({"role": "user", "content": "Go on."})
    alone.messages.append({"role": "user", "content": "Go on."})
    reference = HFPolicy(model, tokenizer, max_context=None, sampling=SamplingOptions(max_new_tokens=6))

    policy.max_context = limit  # the long conversation now fills the context, the short one does not
    policy.reseed(1)
    reference.reseed(1)
    short_turn, long_turn = policy.act([short, long])

    assert long_turn == Turn(text="", truncated=True)
    assert long.token_ids[-1] == policy.encoder.end_of_turn_id and long.loss_mask[-1] == 0 and long.logprobs[-1] == 0.0
    assert policy.context_cuts == 1
    assert id(long) not in policy.turn_cache.entries  # its keys and values are not kept for a turn that never comes
    alone_turn = reference.act([alone])[0]  # the other rows sample as they would alone (from a recomputed cache)
    assert (short_turn.text, short_turn.token_ids) == (alone_turn.text, alone_turn.token_ids)
    torch.testing.assert_close(torch.tensor(short_turn.logprobs), torch.tensor(alone_turn.logprobs), atol=1e-5, rtol=0)
    assert_ledger_reproduced(model, short)


def test_max_context_defaults_to_the_model_positions(model, tokenizer) -> None:
    assert HFPolicy(model, tokenizer).max_context == model.config.max_position_embeddings == SIZES["max_positions"]
    for bad in (0, -5, 2.5, True, "all"):
        with pytest.raises(ValueError, match="max_context"):
            HFPolicy(model, tokenizer, max_context=bad)


def test_an_episode_past_max_context_ends_on_the_empty_reply(model, tokenizer) -> None:
    from cgym.agents.eval.evaluate import EvalConfig, evaluate

    policy = HFPolicy(model, tokenizer, max_context=1, sampling=SamplingOptions(max_new_tokens=4, seed=0))
    summary, results = evaluate(policy, EvalConfig("cgym/ApiReport-v0", episodes=2, batch_size=2))
    assert [len(r.turns) for r in results] == [1, 1]
    assert all(not r.success and r.turns[0] == Turn(text="", truncated=True) for r in results)
    assert summary["context_cuts"] == policy.context_cuts == 2
    summary, _ = evaluate(policy, EvalConfig("cgym/ApiReport-v0", episodes=1))
    assert summary["context_cuts"] == 1  # this eval's cuts, not the policy's lifetime count


CHATML_NO_TOOLS = (  # SmolLM2's kind of template: ChatML turns, no tools section
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("layout", ["json", "compact"])
def test_a_template_without_tools_gets_them_in_its_layout_token_exact(model, tokenizer, layout: str) -> None:
    from cgym.agents.ledger import with_tools_in_system
    from cgym.agents.tool_prompt import set_tool_layout

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = CHATML_NO_TOOLS
    set_tool_layout(bare, layout)  # type: ignore[arg-type]
    policy = HFPolicy(model, bare, sampling=SamplingOptions(max_new_tokens=16, seed=0))
    assert policy.encoder.tools_in_system and policy.encoder.tool_layout == layout
    conv = new_conversation()
    play(policy, [conv], turns=3)
    assert_ledger_reproduced(model, conv)
    text = bare.decode(conv.token_ids, skip_special_tokens=False)
    assert text + "\n" == bare.apply_chat_template(with_tools_in_system(conv.messages, TOOLS, layout), tokenize=False)  # type: ignore[arg-type]
    assert ("get_orders(" in text) == (layout == "compact") and ('"name": "get_orders"' in text.split("<|im_end|>")[0]) == (layout == "json")
