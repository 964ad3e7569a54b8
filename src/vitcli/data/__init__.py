"""Images into batches: synthetic.py (the built-in dataset), tasks.py (the task registry), transforms.py
(preprocessing), sources.py (every image source as a datasets.Dataset), batches.py (map-style batch streams),
streams.py (streamed training batches), prepare.py (a pre-resized copy of a source, `vit prepare-data`)."""
