"""The local inference engine: a transformers causal LM as a policy (`hf:`), batched sampling with
KV caches kept across turns, prompt-lookup drafts, bf16 compute on CPU, and LoRA adapters."""
