"""Images into batches.

bad_images.py (an image that does not decode: named, stood in for, tallied), synthetic.py (the built-in
dataset), jpeg_region.py (a JPEG crop decoded alone, by the C extension _jpeg_region.c where it is built),
decode.py (encoded bytes -> uint8 tensors), pillow_ops.py (Pillow's uint8 ops, batched with
an argument per image), randaugment.py, three_augment.py, erasing.py and
mixing.py (the augmentation ops: drawn on the host, applied batched wherever the pixels are),
augmentations.py (the recipe's augmentation: drawn per micro-batch, applied in order), augment.py (crop
boxes, the batched resize, flip, scaling), transforms.py (what the loader workers do), tasks.py (the task
registry), imagenet.py (ImageNet's label spaces as timm ships them), tar_shards.py (WebDataset tar shards:
naming, columns, writing), folder_index.py (a plain image folder's rows as HF's imagefolder gives them,
listed in seconds and cached), sources.py (every image source as a datasets.Dataset), sampler.py (which
rows and draws each training micro-batch gets), image_cache.py (decoded training images, one bounded copy
for all loader workers, kept only for splits small on disk), batches.py (map-style batch streams),
streams.py (streamed training batches), prepare.py (a pre-resized copy of a source, `vit prepare-data`).

A training micro-batch takes one route (W: a loader worker, D: the model's device); the resize and uint8
ops can run on the device instead (batches.RESIZE_IN_WORKERS, which gpu_check flips to compare), with the
same functions:

| step                    | function                                   | model on the CPU | on a GPU |
|-------------------------|--------------------------------------------|------------------|----------|
| read the encoded bytes  | decode.read (batches, streams: rows)       | W                | W        |
| draw boxes, flips       | augment.draws, from (seed, step, micro)    | W                | W        |
| draw the augmentation   | augmentations.draw, its own numpy stream   | W                | W        |
| decode + crop           | decode.Encoded.pixels (reduced-scale JPEG) | W                | W        |
| resize to S x S, flip   | augment.resize_each / augment.levels (1)   | W                | W        |
| RandAugment, 3-Augment  | augmentations.apply_levels, uint8          | W                | W        |
| scale to [-1, 1], erase | augment.finish, augmentations.apply_normalised | D (the CPU)  | D        |
| Mixup / CutMix          | augmentations.mix, in the training loop    | D                | D        |

(1) Both round to the nearest level (torch's uint8 kernel in the workers, a batched gather on a device),
within one level of each other; evaluation and few-shot keep big_vision's exact truncating resize
(augment.tf_bilinear_clamped). An image that does not decode has one stand-in rule (bad_images.stand_in).
"""
