"""Images into batches.

Four packages, in the order a training image meets them, each `__init__` naming its files:

rows/          where rows come from: every source as a datasets.Dataset (sources.py), read by one reader
               per kind of source (reader_factory.py and reader_*.py), a plain image
               folder's cached index (folder_index.py), WebDataset tar shards (tar_shards.py), the
               built-in data (synthetic.py), the task registry (tasks.py), ImageNet's label spaces
               (imagenet.py), and `vit prepare-data`'s pre-resized copies (prepare.py)
decoding/      encoded bytes into uint8 pixels: decode.py, a JPEG crop decoded alone (jpeg_region.py, by the
               C extension _jpeg_region.c), the bounded decoded-image cache (image_cache.py), and
               the one rule for an image that does not decode (bad_images.py)
augmentation/  crops, resizes and the recipe's augmentation, batched (augment.py, augmentations.py, the ops
               pillow_ops.py, randaugment.py, three_augment.py, erasing.py, mixing.py) and what the
               loader workers run (transforms.py)
batching/      which rows and draws each micro-batch gets (sampler.py), map-style batch streams
               (batches.py) and streamed ones (streams.py)

A training micro-batch takes one route (W: a loader worker, D: the model's device); the resize and
uint8 ops can run on the device instead (batches.RESIZE_IN_WORKERS, which gpu_check flips to
compare), with the same functions:

| step                    | function                                   | model on the CPU | on a GPU |
|-------------------------|--------------------------------------------|------------------|----------|
| read the encoded bytes  | decode.read (batches, streams: rows)       | W                | W        |
| draw boxes, flips       | augment.draws, from (seed, step, micro)    | W                | W        |
| draw the augmentation   | augmentations.draw, its own numpy stream   | W                | W        |
| decode + crop           | decode.Encoded.pixels (JPEG: the crop alone) | W                | W        |
| resize to S x S, flip   | augment.resize_each / augment.levels (1)   | W                | W        |
| RandAugment, 3-Augment  | augmentations.apply_levels, uint8          | W                | W        |
| normalise, erase        | augment.finish, augmentations.apply_normalised | D (the CPU)  | D        |
| Mixup / CutMix          | augmentations.mix, in the training loop    | D                | D        |

(1) Both round to the nearest level (torch's uint8 kernel in the workers, a batched gather on a
device), within one level of each other; evaluation and few-shot keep big_vision's exact truncating
resize (augment.tf_bilinear_clamped). An image that does not decode has one stand-in rule
(bad_images.stand_in).
"""
