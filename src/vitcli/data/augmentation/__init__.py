"""Crops, resizes and the recipe's augmentation, batched: pillow_ops.py (Pillow's uint8 ops, an
argument per image), randaugment.py, three_augment.py, erasing.py and mixing.py (the augmentation
ops: drawn on the host, applied batched wherever the pixels are), augmentations.py (the recipe's
augmentation: drawn per micro-batch, applied in order), augment.py (crop boxes, the batched resize,
flip, scaling) and transforms.py (what the loader workers do); DINO's multi-crop views, drawn per
image (multicrop.py), with BYOL's colour ops on each crop (colour.py)."""
