"""Turns a checkpoint into served tokens: weight loading, engine, sampler, tokenizer.

Everything between the model definition and the user-facing API lives here."""
