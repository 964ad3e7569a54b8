"""Images into batches: synthetic.py (the built-in dataset), decode.py (encoded bytes -> uint8 tensors),
augment.py (batched crop boxes, resize, flip, scaling on the model's device), randaugment.py
(timm's RandAugment batched on uint8 tensors, on any device), transforms.py (preprocessing in
the loader workers), tasks.py (the task registry), sources.py (every image source as a datasets.Dataset),
batches.py (map-style batch streams), streams.py (streamed training batches), prepare.py (a pre-resized copy
of a source, `vit prepare-data`)."""
