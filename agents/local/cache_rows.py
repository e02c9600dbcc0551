"""Rows and columns of the sampler's per-layer cache buffers, moved for all layers in one C call.

When rows leave a decode batch, each layer's keys and values were copied into new buffers of the
rows kept (`torch.index_select`, two a layer: 60 for SmolLM2), and when a row's turn ended its
keys and values for the turn cache were gathered by advanced indexing, two a layer again. Here
one call does either for every buffer: the kept rows move down in place (only those after the
first row to go), and a row's columns land in one block that the turn cache holds as per-layer
views. The same bytes either way: nothing is computed. Both answer None or False where they do
not apply (no kernel here, buffers of other shapes, dtypes or layouts), and the caller keeps its
PyTorch path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import torch
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from torch import Tensor

_SOURCE = (
    C_HEADER
    + r"""
/* Each of n (B, H, cap, row) buffers: row keep[i] moved to row i for its first `length` columns,
   in place; keep ascends and keep[i] >= i, so a row is read before it is written. A buffer's
   rows go in order, the buffers in parallel. */
void compact_rows(char *const *buffers, long n, const long *keep, long kept, long heads, long cap, long row, long length, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long b = 0; b < n; b++)
        for (long i = 0; i < kept; i++) {
            if (keep[i] == i) continue;
            for (long h = 0; h < heads; h++)
                memcpy(buffers[b] + (i * heads + h) * cap * row, buffers[b] + (keep[i] * heads + h) * cap * row, length * row);
        }
}

/* Columns cols[0..m) of row r of each of n (B, H, cap, row) buffers, into out (n, H, m, row). */
void gather_columns(char *const *buffers, long n, long r, const long *cols, long m, long heads, long cap, long row, char *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n * heads * m * row >= (1L << 20))
    for (long b = 0; b < n; b++)
        for (long h = 0; h < heads; h++) {
            const char *from = buffers[b] + (r * heads + h) * cap * row;
            char *to = out + (b * heads + h) * m * row;
            for (long j = 0; j < m; j++) memcpy(to + j * row, from + cols[j] * row, row);
        }
}
"""
)


def _library() -> ctypes.CDLL | None:
    return _built() if enabled() else None


@cache
def _built() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "cache_rows")
    if lib is None:
        return None
    lib.compact_rows.restype = lib.gather_columns.restype = None
    lib.compact_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 5 + [ctypes.c_int]
    lib.gather_columns.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p, ctypes.c_int]
    return lib


def _alike(buffers: Sequence[Tensor]) -> bool:
    """Contiguous (B, H, cap, D) CPU buffers of one shape and dtype."""
    first = buffers[0]
    return first.dim() == 4 and all(b.shape == first.shape and b.dtype == first.dtype and b.device.type == "cpu" and b.is_contiguous() for b in buffers)


def _addresses(buffers: Sequence[Tensor]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])


def compact_rows(buffers: Sequence[Tensor], keep: Tensor, length: int) -> bool:
    """Move rows `keep` (ascending) of each buffer to its first rows, in place, for the first
    `length` columns; False (nothing moved) where the kernel does not apply."""
    lib = _library()
    if lib is None or not buffers or not _alike(buffers) or not 0 <= length <= buffers[0].shape[2]:
        return False
    kept = keep.to(torch.long).contiguous()
    if kept.dim() != 1 or (kept.numel() and (int(kept[0]) < 0 or int(kept[-1]) >= buffers[0].shape[0] or not bool((kept[1:] > kept[:-1]).all()))):
        return False  # rows ascending, within the buffers: then keep[i] >= i
    _, heads, cap, dim = buffers[0].shape
    row = dim * buffers[0].element_size()
    lib.compact_rows(_addresses(buffers), len(buffers), kept.data_ptr(), kept.numel(), heads, cap, row, length, torch.get_num_threads())
    return True


def gather_columns(buffers: Sequence[Tensor], row: int, columns: Tensor) -> list[Tensor] | None:
    """Each buffer's (H, m, D) columns `columns` of row `row`, copied into one block (views of
    it, in the buffers' order); None where the kernel does not apply."""
    lib = _library()
    if lib is None or not buffers or not _alike(buffers) or not 0 <= row < buffers[0].shape[0]:
        return None
    cols = columns.to(torch.long).contiguous()
    if cols.dim() != 1 or (cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= buffers[0].shape[2])):
        return None
    _, heads, cap, dim = buffers[0].shape
    out = buffers[0].new_empty((len(buffers), heads, cols.numel(), dim))
    lib.gather_columns(
        _addresses(buffers), len(buffers), row, cols.data_ptr(), cols.numel(), heads, cap, dim * out.element_size(), out.data_ptr(), torch.get_num_threads()
    )
    return list(out.unbind(0))
