"""Rows into batches: sampler.py (which rows and draws each training micro-batch gets), batches.py
(map-style batch streams, for training and evaluation) and streams.py (streamed training
batches)."""
