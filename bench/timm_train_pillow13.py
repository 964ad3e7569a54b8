"""Run timm's train.py (its path, then its arguments) with one change: RandAugment's posterize at 0 bits gives
a black image (TF's result, and ours) instead of Pillow 13's ValueError.

timm's increasing posterize (`rand-...-inc1`, DeiT's spec) asks for 0 bits at magnitude 10, which
`rand-m9-mstd0.5-inc1` draws now and then; Pillow 13 refuses 0 bits, so train.py stops at its first such image
(`ValueError: bits must be between or equal to 1 and 8`). Nothing else is touched: the rest is train.py as
its repository ships it. bench/rehearse.py launches timm's side through this file and says so in its JSON.

    python bench/timm_train_pillow13.py path/to/train.py --data-dir ... (train.py's arguments)
"""

import runpy
import sys

import timm.data.auto_augment as timm_aa
from PIL import Image


def posterize(img, bits_to_keep, **kwargs):
    """timm's posterize, with 0 bits black."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ORIGINAL(img, bits_to_keep, **kwargs)


ORIGINAL = timm_aa.posterize
# RandAugment looks its ops up in this table when it builds them, so the table is what has to change
timm_aa.NAME_TO_OP = {k: (posterize if v is ORIGINAL else v) for k, v in timm_aa.NAME_TO_OP.items()}

if __name__ == "__main__":
    sys.argv = sys.argv[1:]  # train.py's own argv: its path, then its arguments
    runpy.run_path(sys.argv[0], run_name="__main__")
