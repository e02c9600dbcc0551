"""Adapters that run critique-gym envs inside other frameworks: TRL, OpenEnv, SkyRL-gym, MCP."""
