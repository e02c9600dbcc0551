"""A kernel that finds no memory for its scratch says so and writes nothing; none of them crashes.

The scratch used to be taken by each thread inside its parallel region and used unchecked, so
a failed allocation was a segfault. One child process runs every case: it makes the inputs,
caps its address space a little above what it then maps (`RLIMIT_AS`), so that the kernel's
scratch and nothing before it cannot be had, calls the kernel, and lifts the cap again.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cgym.agents.local import decode_attention

requires_kernel = pytest.mark.skipif(not decode_attention.available(), reason="no C compiler or no AVX-512 here: no kernel runs")

CHILD = r"""
import json, resource, torch
from cgym.agents.local.decode_attention import block_attention, own_attention
from cgym.agents.local.packed import _library, _pairs
from cgym.agents.local.pick import pick_rows
from cgym.agents.local.step_attention import step_attention

MARGIN = 16 << 20  # bytes the process may map past what it holds when capped
_, HARD = resource.getrlimit(resource.RLIMIT_AS)


def capped(call):
    # call() with the address space capped at what the process maps now plus MARGIN
    pages = int(open("/proc/self/statm").read().split()[0])
    resource.setrlimit(resource.RLIMIT_AS, (pages * resource.getpagesize() + MARGIN, HARD))
    try:
        return call()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (HARD, HARD))


def report(name, answer):
    print(json.dumps({name: answer}), flush=True)


torch.manual_seed(0)
bf16 = lambda *shape: torch.randn(*shape).to(torch.bfloat16)

# own_attention: 16 queries' scores over 400k keys, ~26 MB a thread
q, k, v = bf16(1, 1, 16, 64), bf16(1, 1, 400_000, 64), bf16(1, 1, 400_000, 64)
seen = torch.ones(1, 1, 400_000, dtype=torch.bool)
assert own_attention(q, k[:, :, :64], v[:, :, :64], seen[:, :, :64], 0.125) is not None  # built, threads up
report("own_attention", capped(lambda: own_attention(q, k, v, seen, 0.125)) is None)

# block_attention: 200k keys packed and values widened, ~80 MB a thread
q, k, v = bf16(1, 1, 8, 64), bf16(1, 1, 200_000, 64), bf16(1, 1, 200_000, 64)
assert block_attention(q, k[:, :, :64], v[:, :, :64], None, 0.125) is not None
report("block_attention", capped(lambda: block_attention(q, k, v, None, 0.125)) is None)

# step_attention: 3 query heads x 5 ids over 200k own keys, packed (more than FEW_QUERIES)
q, k, v = bf16(1, 3, 5, 64), bf16(1, 1, 200_000, 64), bf16(1, 1, 200_000, 64)
seen = torch.ones(1, 5, 200_000, dtype=torch.bool)
assert step_attention(q, None, k[:, :, :64], v[:, :, :64], seen[:, :, :64].contiguous(), 0.125) is not None
report("step_attention", capped(lambda: step_attention(q, None, k, v, seen, 0.125)) is None)

# pick_rows: one row of 50M logits, its block sums ~12 MB a thread
logits = bf16(1, 50_000_000)
assert pick_rows(logits[:, :1000], 0.0, None) is not None
report("pick_rows", capped(lambda: pick_rows(logits, 0.0, None)) is None)

# pair_linear: 20,000 rows widened (46 MB) do not fit; the pair loop, which widens nothing, runs
lib = _library()
x, w = bf16(20_000, 576), _pairs(bf16(64, 576) * 0.05)
want, got = torch.empty(20_000, 64, dtype=torch.bfloat16), torch.empty(20_000, 64, dtype=torch.bfloat16)
lib.pair_linear(x.data_ptr(), w.data_ptr(), None, want.data_ptr(), 20_000, 576, 64, torch.get_num_threads())
capped(lambda: lib.pair_linear(x.data_ptr(), w.data_ptr(), None, got.data_ptr(), 20_000, 576, 64, torch.get_num_threads()))
report("pair_linear", torch.equal(got, want))
"""


@requires_kernel
def test_kernels_without_room_for_scratch_answer_none_and_do_not_crash() -> None:
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    answers = {name: value for line in child.stdout.splitlines() if line.startswith("{") for name, value in json.loads(line).items()}
    assert child.returncode == 0, f"the child died ({child.returncode}) after {list(answers)}:\n{child.stderr[-3000:]}"
    assert answers == {"own_attention": True, "block_attention": True, "step_attention": True, "pick_rows": True, "pair_linear": True}
