"""Evaluators the loop runs when due, small and uniform: each yields (metric name, value). heldout.py:
held-out top-1 and masked patch prediction on a split."""
