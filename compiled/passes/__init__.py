"""Graph passes over the traced model, each a small object with one rewrite, its order rules and
a source hash; `manager` chooses each graph variant's pass list, checks it and runs it in order."""
