"""Mixture-of-experts routing and expert compute as custom ops.

Softmax-topk-renormalise routing and a torch reference for the expert GEMMs."""
