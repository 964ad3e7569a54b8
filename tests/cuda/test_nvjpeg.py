"""data.decode_device=model on CUDA: nvJPEG decodes what libjpeg-turbo decodes, a truncated file fails as it
does on the CPU, and a decode never writes over memory that work still queued on the training stream reads."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from vitcli.data.decode import decode_jpegs

SIZES = [(375, 500), (480, 640), (333, 500), (500, 375)]


def jpeg(seed: int, hw: tuple[int, int]) -> torch.Tensor:
    """A photograph-like JPEG (gradient, blobs, grain) of (height, width) `hw`, quality 90, as uint8 bytes."""
    rng = np.random.default_rng(seed)
    h, w = hw
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = rng.uniform(0, 255, 3) * (x / w)[..., None] + rng.uniform(0, 255, 3) * (y / h)[..., None]
    img = np.clip(img / 2 + rng.normal(0, 10, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def test_nvjpeg_decodes_what_libjpeg_decodes(cuda):
    files = [jpeg(i, hw) for i, hw in enumerate(SIZES)]
    on_gpu, on_cpu = decode_jpegs(files, cuda), decode_jpegs(files, torch.device("cpu"))
    for g, c, hw in zip(on_gpu, on_cpu, SIZES):
        assert g.shape == c.shape == (3, *hw) and g.device == cuda
        diff = (g.cpu().int() - c.int()).abs()
        # two IDCTs and two chroma upsamplers: within a level or two, never a different picture
        assert diff.float().mean() < 1.0 and diff.max() <= 16, (diff.float().mean(), diff.max())


def test_a_truncated_jpeg_fails_on_the_gpu_as_on_the_cpu(cuda):
    good, cut = jpeg(0, (375, 500)), jpeg(1, (375, 500))
    cut = cut[: len(cut) * 2 // 3].clone()
    on_cpu = decode_jpegs([good, cut], torch.device("cpu"))
    on_gpu = decode_jpegs([good, cut], cuda)
    assert isinstance(on_gpu[0], torch.Tensor)
    assert isinstance(on_cpu[1], Exception) == isinstance(on_gpu[1], Exception), (on_cpu[1], on_gpu[1])


def _corrupted(decode, cuda, rounds: int = 20) -> int:
    """Rounds in which memory freed on the current stream, still read by queued work, was overwritten while
    `decode` ran: per round, tensors of the decoded images' sizes are summed behind a ~0.1 s stall on the
    stream and freed at once (the caching allocator may hand their blocks to the next allocation on that
    stream), then the decode runs (pytorch/vision PR 9606's reproduction)."""
    files = [jpeg(i, hw) for i, hw in enumerate(SIZES)]
    bad = 0
    for r in range(rounds):
        victims = [torch.full((3, *hw), (r + i) % 200 + 1, dtype=torch.uint8, device=cuda)
                   for i, hw in enumerate(SIZES)]
        expected = [int(v.numel()) * ((r + i) % 200 + 1) for i, v in enumerate(victims)]
        torch.cuda._sleep(200_000_000)
        sums = [v.sum(dtype=torch.int64) for v in victims]
        del victims
        decode(files)
        bad += any(int(s) != e for s, e in zip(sums, expected))
    return bad


def test_a_decode_never_writes_over_memory_queued_work_still_reads(cuda):
    assert _corrupted(lambda files: decode_jpegs(files, cuda), cuda) == 0


def test_the_race_test_sees_torchvisions_own_call_corrupt(cuda):
    """The control: torchvision's decode called on the training stream, as decode_jpegs did before."""
    raw = _corrupted(lambda files: decode_jpeg(files, mode=ImageReadMode.RGB, device=cuda), cuda)
    if raw == 0:
        pytest.skip("torchvision's own decode corrupted nothing here: the race test proves nothing on this "
                    "card, driver and torchvision")
