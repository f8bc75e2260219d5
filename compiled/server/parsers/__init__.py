"""Parsers of a chat's output: tool calls (`tool_calls.py`, Qwen3's hermes format) and reasoning
(`reasoning.py`, `<think>...</think>`), each for a whole text and for a stream of deltas."""
