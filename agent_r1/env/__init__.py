"""Environments: the `Env` protocol, `ToolEnv` (hermes tool calls), prompt formats (messages -> ids, once)."""
