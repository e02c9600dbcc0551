"""Policies served elsewhere: any OpenAI-compatible server (`openai:`) and in-process vLLM (`vllm:`)."""
