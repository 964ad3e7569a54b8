"""Evaluators the loop runs when due, small and uniform: each yields (metric name, value).
inference.py: the one sharded inference pass over a split (also few-shot's feature extraction), its
rows gathered back in order; classify.py: top-k, per-class accuracy, confusion matrix and ImageNet
ReaL from per-row predictions (pure numpy); robustness.py: which ImageNet set (val, V2, A, R,
Sketch) a split is and the classes it is scored over; heldout.py: held-out top-1 and loss, or a
self-supervised objective's own losses, on a split; calibration.py: ECE, NLL and temperature
scaling; tta.py: probabilities averaged over test-time views (flip, five crops)."""
