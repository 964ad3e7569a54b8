"""data.decode_device at resolve time: a value outside worker | model, and `model` with 0/1 pixels (stretched
in the workers), are one line, exit 2, from `vit pretrain --dry-run`; the augmentation runs where the pixels
are, so `model` takes all of it."""

import pytest

from helpers import run_vit

STEPS = ("schedule.steps=10", "schedule.warmup_steps=1")


@pytest.mark.parametrize("args, needles", [
    (["data.decode_device=gpu"], ["data.decode_device: 'gpu' is not one of worker, model"]),
    (["data.decode_device=model", "data.binary_pixels=true"], ["data.decode_device=model",
                                                               "data.binary_pixels"]),
])
def test_decode_device_refusals_are_one_line(args, needles, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", *STEPS, *args)
    lines = err.strip().splitlines()
    assert code == 2 and not out and len(lines) == 1 and all(n in lines[0] for n in needles), err


def test_model_decoding_resolves(monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", *STEPS, "data.decode_device=model")
    assert code == 0 and "decode_device: model" in out, err


def test_model_decoding_takes_the_augmentation(monkeypatch, capsys):
    deit = ["data.randaugment=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "data.mixup_alpha=0.8",
            "data.cutmix_alpha=1.0"]
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", *STEPS, "data.decode_device=model",
                             *deit)
    assert code == 0 and "randaugment: rand-m9-mstd0.5-inc1" in out and "cutmix_alpha: 1.0" in out, err
