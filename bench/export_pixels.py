"""How far the image processor `vit export --format hf` writes is from vit's own eval pixels, in 8-bit
levels, at 224 px: transformers' AutoImageProcessor on an exported folder (a 1-block ViT, random
weights: only its preprocessing matters) against vit's eval transform, beside the BitImageProcessor the
export wrote before (transformers' centre crop floors the offset where vit's rounds it half to even),
on scikit-image's four photographs resized to 640 x 427 and 427 x 640 (crop margins 111 and 159 at crop
1.0 and 0.875: 3 mod 4, where the two crops differ by a pixel).

    python bench/export_pixels.py   # a table on stdout, ~1 min on 2 cores
"""

from __future__ import annotations

import io
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import skimage.data
import torch
import transformers
from PIL import Image
from timm.models.vision_transformer import VisionTransformer

from vitcli.checkpoints.weights import save_weights
from vitcli.data.augmentation.augment import Normalise, finish
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.decoding.decode import Encoded
from vitcli.models.zoo import model_spec
from vitcli.recipe.schema import DataConfig, ModelConfig

SIZE = 224
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
NET = ModelConfig(name="custom", img_size=SIZE, patch_size=16, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")


def exported(data: dict, root: Path):
    """AutoImageProcessor on the hf export of a checkpoint whose recipe says `data`."""
    net = VisionTransformer(img_size=SIZE, patch_size=16, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2,
                            num_classes=3)
    ckpt = root / "m.safetensors"
    save_weights(ckpt, net.state_dict(), {"model": model_spec(NET, 3), "recipe": {"data": data}})
    out = root / "hf"
    subprocess.run([sys.executable, "-m", "vitcli", "export", "--ckpt", str(ckpt), "--format", "hf", "--out",
                    str(out), "--overwrite"], check=True, capture_output=True)
    return transformers.AutoImageProcessor.from_pretrained(out)


def ours(img: Image.Image, data: DataConfig) -> torch.Tensor:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    pixels = build_transform(data, SIZE, train=False)([Encoded(buf.getvalue())], None)
    return finish(pixels, torch.device("cpu"), normalise=Normalise(data.mean, data.std))[0]


def main() -> None:
    std = torch.tensor(IMAGENET["std"]).view(3, 1, 1)
    for interpolation in ("bilinear", "bicubic", "nearest"):
        for crop in (1.0, 0.875):
            data = {"interpolation": interpolation, "eval_crop_pct": crop, **IMAGENET}
            with tempfile.TemporaryDirectory() as tmp:
                now = exported(data, Path(tmp))
            before = transformers.BitImageProcessor(
                size={"shortest_edge": math.floor(SIZE / crop)}, crop_size={"height": SIZE, "width": SIZE},
                resample={"nearest": 0, "bilinear": 2, "bicubic": 3}[interpolation],
                image_mean=IMAGENET["mean"], image_std=IMAGENET["std"])
            worst = {"now": 0.0, "before": 0.0}
            for name in PHOTOS:
                photo = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
                for size in ((640, 427), (427, 640)):
                    img = photo.resize(size, Image.BICUBIC)
                    mine = ours(img, DataConfig(**data))
                    for key, processor in (("now", now), ("before", before)):
                        theirs = processor(images=img, return_tensors="pt")["pixel_values"][0]
                        worst[key] = max(worst[key], ((theirs - mine).abs() * std * 255).max().item())
            print(f"{interpolation:8s} crop {crop}: {type(now).__name__} {worst['now']:.0f} levels, "
                  f"BitImageProcessor before {worst['before']:.0f}")


if __name__ == "__main__":
    main()
