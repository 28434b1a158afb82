"""Anthropic Messages and count_tokens."""
