"""Policies: scripted, local transformers models, OpenAI-compatible servers, vLLM."""
