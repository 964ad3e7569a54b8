"""Frozen-feature evaluation, in its steps: solver.py (closed-form ridge, pure numpy), knn.py
(DINO's weighted kNN), probe.py (the logistic probe, CLIP's protocol) < features.py (frozen
pre-logits, cached) < protocols.py (the all-data protocols on one task's features) < evaluate.py
(tasks -> shots x seeds -> scores, and the protocols) < report.py (tables, json, csv, png)."""
