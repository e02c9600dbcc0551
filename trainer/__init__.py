"""Rollouts, advantages, losses and the GRPO / Critique-GRPO training loop."""
