"""Linear few-shot evaluation, in its steps: solver.py (closed-form ridge, pure numpy) < features.py (frozen
pre-logits, cached) < evaluate.py (tasks -> shots x seeds -> scores) < report.py (table, json, csv, png)."""
