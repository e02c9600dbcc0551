"""Write a small Llama model as a GGUF file with the `gguf` package, as llama.cpp lays one out.

The weights come from a random `LlamaForCausalLM`, so a test can convert the file back and
compare logits; the tokenizer is a byte-level BPE (gpt2-style vocabulary and merges).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# SmolLM2's template: it ignores `tools`, which is what the encoder must work around.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q/k projections (rotary halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def small_llama(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, chat_template: str = SMOL_TEMPLATE) -> Path:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, tokenizer, chat_template)
    for name, tensor in _gguf_tensors(model).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: object, tokenizer: PreTrainedTokenizerFast, chat_template: str) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    for token, index in special.items():
        if index >= len(tokens):
            tokens.append(token)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["<|im_start|>"])
    writer.add_eos_token_id(special["<|im_end|>"])
    writer.add_pad_token_id(special["<|im_end|>"])
    writer.add_chat_template(chat_template)


def _gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    names = {
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        out[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(sd[prefix + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        out[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(sd[prefix + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        for hf_name, gguf_name in names.items():
            out[f"blk.{i}.{gguf_name}.weight"] = sd[prefix + hf_name + ".weight"]
    return out
