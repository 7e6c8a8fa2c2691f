"""OpenAI-compatible HTTP server: `slipstream serve` (see serve/cli.py and serve/app.py)."""
