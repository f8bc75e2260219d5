"""Graph passes over the traced model, each a small object with one rewrite, its order rules and
a source hash; `manager` checks a pass list and runs it in order."""
