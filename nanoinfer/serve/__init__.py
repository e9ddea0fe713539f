"""The OpenAI-compatible HTTP server: `nanoinfer serve MODEL` (see cli.py)."""
