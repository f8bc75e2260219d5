"""The HTTP routes, one module a concern: completions, chat, models and adapters, tokenize,
metrics and health; `generate.py` runs what completions and chat share."""
