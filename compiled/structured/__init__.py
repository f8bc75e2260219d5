"""Constrained decoding: what a request asks its output to match (a JSON schema, a regex, a
choice, an EBNF grammar), the grammars compiled for it and the token masks that enforce it."""
