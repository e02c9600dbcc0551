"""The embedded tiny model: a tokenizer trained on env text and a tiny Qwen2, built here.

`cgym tiny` = train the BPE on scripted transcripts of every built-in env (~5 s), initialise the
model, then pre-train it for a short while on synthetic drills (`trainer.tiny.copy_drills` and
`trainer.tiny.lookup_drills`), so that SFT on demonstrations learns to copy names, ids and values
from the context within its few-minute budget instead of stalling on the prior (see `COPY_PRETRAIN`).
"""

from __future__ import annotations

from pathlib import Path

from cgym.agents.demos import Demo, corpus, demonstrations
from cgym.agents.pretrained import EMBEDDED_MODEL, publish_built
from cgym.envs.registration import registered
from cgym.trainer.sft import fit
from cgym.trainer.tiny import build_tiny, copy_drills, lookup_drills
from transformers import AutoTokenizer

# Two layers with a key/value head per query head: copy circuits form much faster than with 4
# layers and 2 kv heads (short copy drills, ~60 s on 2 cores: loss 1.7 after 1,000 steps vs 4.2
# after 400, the most the deeper model ran in that time), and each SFT and GRPO step is ~1.7x
# cheaper. Measured figures are in the README.
TINY_SIZES = {"vocab_size": 4096, "hidden_size": 192, "num_layers": 2, "num_heads": 6, "num_kv_heads": 6}
# Drills before SFT: `steps` batches of `batch_size`, half short copy drills, half key look-ups
# (~70 s on 2 CPU cores); 0 steps skips them. In tuning runs (1,000 drill steps, 210 s of SFT),
# the model drilled on copies alone copied ids and dates but wrote one city for every customer (26%
# on easy); with the look-ups mixed in, 83% in that run. The outcome swings from run to run: the
# committed quickstart plan gives 44%, and with 1,000 drill steps it gave 29%.
COPY_PRETRAIN = {"steps": 800, "batch_size": 32, "lr": 3e-3, "lookup_share": 0.5, "min_len": 4, "max_len": 16}


def tokenizer_corpus(*, episodes_per_difficulty: int = 150, seed: int = 0) -> list[Demo]:
    """Transcripts of scripted agents on every built-in env family and difficulty."""
    demos: list[Demo] = []
    for env_id in (e for e in registered() if e.startswith("cgym/")):
        for difficulty in ("easy", "medium", "hard"):
            demos += demonstrations(env_id, {"difficulty": difficulty}, episodes=episodes_per_difficulty, seed=seed, imperfect=0.3)
    return demos


def build_embedded_model(out: Path, *, seed: int = 0, copy_steps: int | None = None, progress: bool = True) -> Path:
    """`cgym tiny`: train the tokenizer on env text, initialise the tiny model, pre-train it on
    copy and look-up drills (`copy_steps`, default `COPY_PRETRAIN["steps"]`), save both."""
    steps = COPY_PRETRAIN["steps"] if copy_steps is None else copy_steps
    out = build_tiny(out, corpus(tokenizer_corpus(seed=seed)), seed=seed, **TINY_SIZES)
    if steps > 0:
        batch_size = COPY_PRETRAIN["batch_size"]
        tokenizer = AutoTokenizer.from_pretrained(out)
        lookups = round(steps * batch_size * COPY_PRETRAIN["lookup_share"])
        drills = copy_drills(tokenizer, steps * batch_size - lookups, min_len=COPY_PRETRAIN["min_len"], max_len=COPY_PRETRAIN["max_len"], seed=seed)
        drills += lookup_drills(tokenizer, lookups, seed=seed)
        fit(out, drills, out, epochs=1.0, lr=COPY_PRETRAIN["lr"], batch_size=batch_size, seed=seed, progress=progress, label="drills")
    return out


def ensure_embedded_model(*, progress: bool = True) -> Path:
    """The embedded model's cached directory, built there once (about a minute on 2 cores)."""
    return publish_built(EMBEDDED_MODEL, lambda directory: build_embedded_model(directory, progress=progress))


def prepare_models(*specs: str | None, progress: bool = True) -> None:
    """Build the embedded model first if any policy or model spec names it (`tiny`, `hf:tiny`),
    so that the policy layer, which only loads models, finds it in the cache."""
    if any(spec is not None and str(spec).removeprefix("hf:") == EMBEDDED_MODEL for spec in specs):
        ensure_embedded_model(progress=progress)
