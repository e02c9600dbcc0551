"""Rollout samplers used only in training: a served model the trainer pushes its weights to, or
an in-process vLLM engine on a GPU."""
