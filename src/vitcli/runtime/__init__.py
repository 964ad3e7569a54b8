"""What every stage runs on: files.py (atomic writes, checksums), precision.py, rngs.py, metrics.py
(metrics.jsonl, the console, the progress bar), trackers.py (TensorBoard, W&B), dist.py (processes and
devices), workdir.py (output locations checked before anything is written)."""
