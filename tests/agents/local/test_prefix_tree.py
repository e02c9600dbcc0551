"""The prefix-tree loss pass: the layout, and log-probs and gradients equal to the padded pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.local.prefix_tree import prefix_tree, takes_trees, tree_logprobs, tree_size
from cgym.agents.local.sampling import sequence_logprobs, shared_head
from cgym.trainer.tiny import build_tiny
from transformers import AutoModelForCausalLM

from tests.agents.local.test_hf import SIZES, chat_corpus

ROWS = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [5, 6, 7], [4], [5, 6, 7, 8, 1]]


def brute_visible(rows: list[list[int]]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Each distinct prefix once, and who sees whom: a prefix sees the prefixes of itself."""
    prefixes = sorted({tuple(row[: n + 1]) for row in rows for n in range(len(row))})
    seen = torch.tensor([[len(b) <= len(a) and a[: len(b)] == b for b in prefixes] for a in prefixes])
    return prefixes, seen


def test_the_tree_holds_each_distinct_prefix_once_and_sees_exactly_its_ancestors() -> None:
    tree = prefix_tree(ROWS)
    prefixes, seen = brute_visible(ROWS)
    # depth first with children in id order is the sorted order of the prefixes
    assert [prefixes[i][-1] for i in range(len(prefixes))] == tree.ids
    assert tree.depth == [len(p) - 1 for p in prefixes]
    assert torch.equal(tree.visible(), seen)
    assert len(tree) == tree_size(ROWS) == 7
    for row, path in zip(ROWS, tree.paths, strict=True):
        assert [tree.ids[node] for node in path] == row
        assert path == [prefixes.index(tuple(row[: n + 1])) for n in range(len(row))]


@pytest.mark.parametrize("seed", range(5))
def test_random_rows_give_the_brute_force_tree(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    stem = torch.randint(0, 3, (6,), generator=gen).tolist()
    rows = [
        stem[: int(torch.randint(0, 7, (1,), generator=gen))] + torch.randint(0, 3, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(7)
    ]
    tree = prefix_tree(rows)
    prefixes, seen = brute_visible(rows)
    assert len(tree) == len(prefixes) == tree_size(rows)
    assert torch.equal(tree.visible(), seen)
    assert all([tree.ids[node] for node in path] == row for row, path in zip(rows, tree.paths, strict=True))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny-tree"), chat_corpus(), **SIZES)


def tree_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows past a 20-id head: two pairs that agree for a while after it (one pair
    for 12 ids, one for 5), a duplicate row, and targets scored where they agree and where not."""
    gen = torch.Generator().manual_seed(2)
    draw = lambda n: torch.randint(3, 200, (n,), generator=gen).tolist()  # noqa: E731
    head, a, b = draw(20), draw(12), draw(5)
    rows = [head + a + draw(7), head + a + draw(3), head + b + draw(9), head + b + draw(2), head + draw(6)]
    rows.append(list(rows[0]))
    width = max(len(r) for r in rows)
    ids, attention, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width - 1)
    for r, row in enumerate(rows):
        ids[r, : len(row)], attention[r, : len(row)] = torch.tensor(row), 1
        mask[r, 22 : len(row) - 1 : 2] = 1
    mask[:, 31] = (attention[:, 32] == 1).float()  # the last shared column of the first pair
    return ids, attention, mask


@pytest.mark.parametrize("use_head", [False, True], ids=["no-head", "head"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_pass_gives_the_padded_log_probs_and_gradients(tiny_dir: Path, use_head: bool, temperature: float) -> None:
    ids, attention, mask = tree_batch()
    results = []
    for tree in (False, True):
        net = AutoModelForCausalLM.from_pretrained(tiny_dir)
        assert takes_trees(net)
        head = shared_head(net, ids[0, :20]) if use_head else None
        run = tree_logprobs if tree else sequence_logprobs
        lp = run(net, ids, attention, temperature, mask=mask, head=head)
        (lp * mask * torch.linspace(0.5, 1.5, lp.shape[1])).sum().backward()
        if head is not None:
            head.backward()
        results.append((lp.detach() * mask, torch.cat([p.grad.flatten() for p in net.parameters()])))
    (plain_lp, plain_grad), (tree_lp, tree_grad) = results
    assert plain_grad.abs().sum() > 0 and bool((tree_lp[mask.bool()] != 0).all())
    assert bool((tree_lp[~mask.bool()] == 0).all())
    torch.testing.assert_close(tree_lp, plain_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(tree_grad, plain_grad, atol=1e-5, rtol=1e-4)


def test_tree_pass_runs_each_shared_id_once_and_the_lm_head_on_each_scored_node_once(tiny_dir: Path) -> None:
    net = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids, attention, mask = tree_batch()
    head = shared_head(net, ids[0, :20])
    seen: list[tuple[int, ...]] = []
    hooks = [net.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)]
    hooks.append(net.lm_head.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape))))
    try:
        tree_logprobs(net, ids, attention, mask=mask, head=head)
    finally:
        for hook in hooks:
            hook.remove()
    rows = [ids[r, 20 : int(attention[r].sum())].tolist() for r in range(ids.shape[0])]
    paths = prefix_tree(rows).paths
    scored = {paths[r][c - 20] for r, c in mask.nonzero().tolist()}
    assert len(scored) < int(mask.sum())  # the duplicate row's targets, and the pairs' shared column, sit on nodes other rows score
    assert seen == [(1, tree_size(rows)), (1, len(scored), 64)]
    assert tree_size(rows) == sum(len(r) for r in rows) - len(rows[0]) - 12 - 5  # the duplicate, and each pair's shared ids, once


def test_tree_pass_refuses_left_padding_and_rows_the_head_does_not_lead(tiny_dir: Path) -> None:
    net = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids, attention, mask = tree_batch()
    with pytest.raises(ValueError, match="right-padded"):
        tree_logprobs(net, ids, attention.flip(1), mask=mask)
    head = shared_head(net, ids[0, :20])
    other = ids.clone()
    other[1, 3] += 1
    with pytest.raises(ValueError, match="start with"):
        tree_logprobs(net, other, attention, mask=mask, head=head)
    inside = mask.clone()
    inside[0, 5] = 1
    with pytest.raises(ValueError, match="targets inside"):
        tree_logprobs(net, ids, attention, mask=inside, head=head)
