"""Turns a built model into served tokens: engine config, weight loading, model runner, scheduler,
sampler, tokenizer / detokenizer and the `LLM` API."""
