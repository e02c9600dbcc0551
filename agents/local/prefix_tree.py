"""The loss pass over a prefix tree: rows merged where they agree, each shared id run once.

A GRPO group's rows start alike: the task prompt, and often the same tool call, or the same
first words of it, before their samples part. The padded loss pass runs every row whole (past
the batch's shared head and what all rows of a micro-batch share), so each such id runs once per
row, and every row runs as wide as its micro-batch's longest. Here a micro-batch's rows are
merged into a prefix tree (a trie) whose nodes are laid out depth first as one sequence: a node
attends to the shared head and to its ancestors, and sits at its depth's position, so its hidden
state is the one each of its rows would compute, and its rows' gradients add up through it.
On three 4 x 8 rollouts of ApiReport easy (SmolLM2) the padded plan ran 7,132-7,628 columns past
the head and its LM head 4,623-4,824; the tree holds 4,237-4,410 nodes and its LM head takes
only the 3,217-3,295 sampled targets.

`prefix_tree` is the pure part: the layout, who sees whom, and where each row's ids went.
`tree_logprobs` runs it through a model as `sampling.sequence_logprobs` would run the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from cgym.agents.local.kv_cache import read_only_cache, use_prefix_attention
from cgym.agents.local.sampling import SharedHead, _forward_kwargs
from cgym.agents.local.target_logprobs import target_logprobs
from torch import Tensor
from transformers import PreTrainedModel

MODEL_TYPES = ("llama", "qwen2")  # full causal attention in every layer: a given mask is the whole story


@dataclass(frozen=True)
class PrefixTree:
    """Rows of ids as a trie laid out depth first (children in id order).

    Node `i`'s subtree is nodes `i .. i + span[i] - 1`, so node `i` sees node `j` (an ancestor,
    or itself) exactly when `j <= i < j + span[j]`."""

    ids: list[int]  # node -> its id
    depth: list[int]  # node -> its position in each of its rows
    span: list[int]  # node -> nodes in its subtree, itself included
    paths: list[list[int]]  # row -> the node of each of its ids

    def __len__(self) -> int:
        return len(self.ids)

    def visible(self) -> Tensor:
        """(N, N) bool: whether node i (row) attends to node j (column)."""
        node = torch.arange(len(self.ids))
        ends = node + torch.tensor(self.span, dtype=torch.long)
        return (node[None] <= node[:, None]) & (node[:, None] < ends[None])


def prefix_tree(rows: Sequence[Sequence[int]]) -> PrefixTree:
    """The trie of `rows`. In sorted order a row shares the most with the row before it, and the
    ids it adds past that common prefix are the next nodes of a depth-first layout."""
    order = sorted(range(len(rows)), key=lambda r: list(rows[r]))
    ids: list[int] = []
    depth: list[int] = []
    span: list[int] = []
    paths: list[list[int]] = [[] for _ in rows]
    path: list[int] = []  # the nodes of the previous row in sorted order
    previous: Sequence[int] = ()
    for row in order:
        ids_row = rows[row]
        common = _common_prefix(previous, ids_row)
        for node in path[common:]:  # subtrees the sorted rows have left for good
            span[node] = len(ids) - node
        path = path[:common]
        for position in range(common, len(ids_row)):
            path.append(len(ids))
            ids.append(int(ids_row[position]))
            depth.append(position)
            span.append(0)
        paths[row] = list(path)
        previous = ids_row
    for node in path:
        span[node] = len(ids) - node
    return PrefixTree(ids, depth, span, paths)


def tree_size(rows: Sequence[Sequence[int]]) -> int:
    """Nodes of `prefix_tree(rows)`, without building it."""
    ordered = sorted(list(row) for row in rows)
    return sum(len(row) - _common_prefix(before, row) for before, row in zip([[], *ordered], ordered, strict=False))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def takes_trees(model: PreTrainedModel) -> bool:
    """Whether `tree_logprobs` can run `model`: a Llama or Qwen2 layout (causal attention in every
    layer, no sliding window), an LM head that keeps chosen columns, and attention that reads a
    given mask (transformers' SDPA, which `use_prefix_attention` wraps)."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(inner, "config", None)
    return (
        getattr(config, "model_type", None) in MODEL_TYPES
        and not getattr(config, "use_sliding_window", False)
        and _forward_kwargs(model)[1]
        and use_prefix_attention(model)
    )


def tree_logprobs(
    model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0, *, mask: Tensor, head: SharedHead | None = None
) -> Tensor:
    """`sampling.sequence_logprobs` of right-padded (B, T) rows, run as one prefix tree (batch 1):
    (B, T-1) log-probs of `input_ids[:, 1:]` where `mask` is nonzero, 0 elsewhere. Differentiable;
    equal to the padded pass up to float rounding, gradients too. With a `head`, the rows start
    with its ids and nothing inside it is scored; the tree holds what follows. The caller checks
    `takes_trees(model)`."""
    scale = temperature if temperature > 0 else 1.0
    batch, width = input_ids.shape
    lengths = attention_mask.sum(1)
    if not bool((attention_mask == (torch.arange(width, device=attention_mask.device)[None] < lengths[:, None])).all()):
        raise ValueError("tree_logprobs takes right-padded rows")
    start = head.length if head is not None else 0
    if head is not None:
        if int(lengths.min()) <= start or not bool((input_ids[:, :start] == head.ids).all()):
            raise ValueError("every row must start with the shared head's ids and go on after them")
        if bool(mask[:, :start].any()):
            raise ValueError("targets inside a shared head cannot be scored: pass a mask that wants none of them")
    rows = [input_ids[r, start : int(lengths[r])].tolist() for r in range(batch)]
    tree = prefix_tree(rows)
    wanted = mask.nonzero().tolist()  # (row, column): column c's id predicts id c + 1
    nodes = torch.tensor([tree.paths[r][c - start] for r, c in wanted], dtype=torch.long)
    kept, node_row = torch.unique(nodes, return_inverse=True)  # a node that several rows score is run through the head once
    rows_at, columns = (torch.tensor(axis, dtype=torch.long) for axis in zip(*wanted, strict=True)) if wanted else (torch.empty(0, dtype=torch.long),) * 2
    visible = tree.visible()
    if start:
        visible = torch.cat([visible.new_ones(len(tree), start), visible], 1)
    kwargs = {"use_cache": False}
    if head is not None:
        kwargs = {"use_cache": True, _forward_kwargs(model)[0]: read_only_cache(model, head.keys, head.values)}
    use_prefix_attention(model)
    out = model(
        input_ids=torch.tensor(tree.ids, dtype=torch.long, device=input_ids.device)[None],
        attention_mask=visible.to(input_ids.device)[None, None],
        position_ids=(torch.tensor(tree.depth, dtype=torch.long) + start).to(input_ids.device)[None],
        logits_to_keep=kept.to(input_ids.device),
        **kwargs,
    )
    targets = input_ids[rows_at, columns + 1]
    values = target_logprobs(out.logits, targets[None], scale, rows=node_row[None].to(targets.device))[0]
    return values.new_zeros(batch, width - 1).index_put((rows_at.to(values.device), columns.to(values.device)), values)
