"""Each row's next id and its log-prob from bf16 logits, in one C pass per row.

Picking an id took several passes over a (rows, vocabulary) fp32 copy of the logits: the
log-softmax, then for a sampled id one uniform number per vocabulary entry, two logs, a
subtraction and an argmax (the Gumbel-max draw). With SmolLM2's 49,152 ids that was ~1.2 s of a
4 x 8 GRPO rollout on the 2-core machine. Here a row is read three times as bf16: its largest
logit (and the first id holding it), the sum of exps of the scaled logits block by block, and
for a sampled id a walk through those sums to the block, then the id, where the running sum
passes u x total (one uniform u per row, from the caller's generator: inverse-CDF sampling,
exact for the softmax as the Gumbel draw is, though from other random numbers).

`sampling.accept_drafts` takes a decode step's drafted positions the same way where the logits
are bf16 and there is no top-p: the argmax and log-prob of each for greedy rows, and for sampled
ones one id drawn from the position after the last draft kept, a rejected draft left out. A 4 x 8
rollout's ~80 draft checks took 0.30-0.35 s through PyTorch's log-softmax and Gumbel draw,
0.10-0.13 s so (2-core Ice Lake, ad hoc `sel_time.py`).

Greedy rows get the argmax that `torch.argmax` gives (the first id of the largest logit) and
the log-prob of `log_softmax(logits)`; sampled rows that of `log_softmax(logits / T)`, within
fp32 rounding. Top-p sampling keeps the PyTorch path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from torch import Tensor

_SOURCE = (
    C_HEADER
    + r"""
/* Row r of (rows, V) bf16 logits x (rows stride apart): with w_v = exp((x_v - max) inv_t),
   ids[r] = the first argmax if u is NULL, else the first v where w_0 + ... + w_v > u[r] * sum w;
   logp[r] = (x_id - max) inv_t - log(sum w). Answers 0, or -1 with nothing written where there
   is no memory for its scratch. */
int pick_rows(const uint16_t *x, long rows, long V, long stride, float inv_t, const double *u,
              int64_t *ids, float *logp, int threads) {
    long blocks = (V + 15) / 16;
    size_t bytes = sizeof(float) * blocks; /* a thread's block sums */
    char *scratch = thread_scratch(threads, bytes);
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        float *sums = own_slice(scratch, bytes);
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            const uint16_t *row = x + r * stride;
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (long v = 0; v < V; v += 16) {
                __mmask16 m = lanes(V - v);
                top = _mm512_mask_max_ps(top, m, top, load_bf16(row + v, m));
            }
            float high = _mm512_reduce_max_ps(top);
            __m512 peak = _mm512_set1_ps(high), scale = _mm512_set1_ps(inv_t);
            double total = 0.0;
            for (long j = 0; j < blocks; j++) {
                __mmask16 m = lanes(V - j * 16);
                __m512 w = _mm512_maskz_mov_ps(m, exp_neg(_mm512_mul_ps(_mm512_sub_ps(load_bf16(row + j * 16, m), peak), scale)));
                sums[j] = _mm512_reduce_add_ps(w);
                total += sums[j];
            }
            long id = -1;
            if (u == NULL) {
                for (long v = 0; v < V && id < 0; v++)
                    if (bf16_value(row[v]) == high) id = v;
            } else {
                double target = u[r] * total, run = 0.0;
                long j = 0;
                while (j < blocks - 1 && run + sums[j] <= target) run += sums[j++];
                float w[16]; /* the block's weights again, as its sum was taken */
                __mmask16 m = lanes(V - j * 16);
                _mm512_storeu_ps(w, _mm512_maskz_mov_ps(m, exp_neg(_mm512_mul_ps(_mm512_sub_ps(load_bf16(row + j * 16, m), peak), scale))));
                long last = -1;
                for (long i = 0; i < 16 && j * 16 + i < V; i++) {
                    if (w[i] > 0.0f) last = j * 16 + i;
                    run += w[i];
                    if (run > target && w[i] > 0.0f) { id = j * 16 + i; break; }
                }
                if (id < 0) id = last; /* rounding left the target past the block's end */
                for (long v = V - 1; id < 0 && v >= 0; v--)
                    if (bf16_value(row[v]) == high) id = v;
            }
            ids[r] = id;
            logp[r] = (bf16_value(row[id]) - high) * inv_t - (float)log(total);
        }
    }
    free(scratch);
    return 0;
}
"""
)


@cache
def _library() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "pick")
    if lib is None:
        return None
    lib.pick_rows.restype = ctypes.c_int
    lib.pick_rows.argtypes = [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return lib


def pick_rows(logits: Tensor, temperature: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor] | None:
    """(b, V) bf16 logits -> each row's id (b,) and its log-prob (b,): the argmax with
    temperature 0, else a draw from `softmax(logits / temperature)` with one uniform per row from
    `generator`. None where the kernel does not run (another dtype or device, no kernel here, no
    memory for its scratch: the generator has then drawn its uniforms all the same)."""
    if not (
        enabled() and logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] > 0
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    rows, vocab = logits.shape
    uniforms = None if temperature == 0 else torch.rand(rows, generator=generator, dtype=torch.float64)
    ids = torch.empty(rows, dtype=torch.long)
    logp = torch.empty(rows, dtype=torch.float32)
    inv_t = 1.0 if temperature == 0 else 1.0 / temperature
    failed = lib.pick_rows(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        inv_t,
        None if uniforms is None else uniforms.data_ptr(),
        ids.data_ptr(),
        logp.data_ptr(),
        torch.get_num_threads(),
    )
    return None if failed else (ids, logp)
