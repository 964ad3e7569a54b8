"""DINO's multi-crop input (data/augmentation/multicrop.py, colour.py) against the references'
transforms: torchvision's RandomResizedCrop box sampler, ColorJitter / RandomGrayscale /
RandomSolarize on PIL images and DINO's PIL GaussianBlur; each image's crops a function of (seed,
its index in the run), whatever the micro-batch size, accumulation or rank split; the stream's
views, map-style and streamed."""

import io
import itertools

import datasets
import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter, ImageOps
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from vitcli.data.augmentation import augment, colour, multicrop
from vitcli.data.augmentation.multicrop import MultiCrop
from vitcli.data.batching import batches, streams
from vitcli.data.decoding import jpeg_region
from vitcli.data.decoding.decode import Decoded, Encoded
from vitcli.data.rows.synthetic import make_synthetic
from vitcli.recipe.schema import DataConfig, DinoConfig, Recipe, SyntheticConfig
from vitcli.run import feed
from vitcli.runtime.dist import Dist

TINY = MultiCrop(global_size=32, local_crops=2, local_size=16)
N = 16  # images in the tiny split


def _photo(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    """A smooth colour picture with grain, (h, w, 3) uint8: every hue, grey and saturated."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    waves = [np.sin(6 * x + c) * np.cos(4 * y - c) for c in rng.uniform(0, 6, 3)]
    img = np.stack(waves, -1) * 110 + 128
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def _decoded(a: np.ndarray) -> Decoded:
    return Decoded(torch.from_numpy(a).permute(2, 0, 1))


def _jpeg(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=90)
    return buf.getvalue()


# ---- the box sampler: torchvision's RandomResizedCrop.get_params ----

def _torchvision_boxes(h: int, w: int, scale, n: int) -> np.ndarray:
    torch.manual_seed(0)
    img = torch.empty(3, h, w)
    draw = T.RandomResizedCrop.get_params
    return np.array([draw(img, list(scale), [3 / 4, 4 / 3]) for _ in range(n)])


@pytest.mark.parametrize("h, w, scale", [(375, 500, (0.05, 0.4)), (480, 360, (0.4, 1.0)),
                                         (150, 400, (0.4, 1.0))])
def test_the_box_sampler_draws_torchvisions_random_resized_crops(h, w, scale):
    """Same distribution as get_params (ours draws all ten attempts at once, in float64): the mean
    and spread of each coordinate within 4% of the image's side (4,000 boxes each: the standard
    error of a mean is ~0.5%), the share of boxes from the central fallback within 3 points (150 x
    400 at 0.4-1.0 of the area: most attempts overflow the height). Every box lies in the
    image."""
    n = 4000
    ref = _torchvision_boxes(h, w, scale, n)
    rng = np.random.default_rng(0)
    ours = multicrop.rrc_boxes(np.tile([h, w], (n, 1)), np.tile(scale, (n, 1)), rng)
    assert (ours >= 0).all() and (ours[:, 2:] > 0).all()
    assert (ours[:, 0] + ours[:, 2] <= h).all() and (ours[:, 1] + ours[:, 3] <= w).all()
    side = np.array([h, w, h, w])
    assert np.all(np.abs(ours.mean(0) - ref.mean(0)) < 0.04 * side), (ours.mean(0), ref.mean(0))
    assert np.all(np.abs(ours.std(0) - ref.std(0)) < 0.04 * side), (ours.std(0), ref.std(0))
    fallback = multicrop.central_boxes(np.array([[h, w]]))[0]
    share = [np.mean(np.all(b == fallback, 1)) for b in (ours, ref)]
    assert abs(share[0] - share[1]) < 0.03, share


@pytest.mark.parametrize("h, w", [(50, 1000), (1000, 50), (64, 64)])
def test_the_fallback_is_torchvisions_central_crop(h, w):
    """No attempt fits (the scale's smallest area is past the image's): get_params's central crop,
    exactly (its height or width cut to the ratio bound, rounded; margins floored)."""
    ref = _torchvision_boxes(h, w, (1.2, 1.5), 1)[0]
    rng = np.random.default_rng(0)
    ours = multicrop.rrc_boxes(np.array([[h, w]]), np.array([[1.2, 1.5]]), rng)[0]
    np.testing.assert_array_equal(ours, ref)


# ---- the colour ops against torchvision's on PIL images ----

def _crops() -> list[Image.Image]:
    grey = np.repeat(_photo(40, 40, 3)[..., :1], 3, -1)
    noise = np.random.default_rng(2).integers(0, 256, (24, 24, 3), np.uint8)
    return [Image.fromarray(a) for a in (_photo(), _photo(32, 32, 1), noise, grey)]


@pytest.mark.parametrize("factor", [0.1, -0.1, 0.0, 0.0371, -0.0999, 0.5, -0.5])
def test_the_hue_is_torchvisions_adjust_hue_of_a_pil_image_bit_for_bit(factor):
    """The tables are PIL's own conversions: no departure, at any level, grey images included."""
    for img in _crops():
        np.testing.assert_array_equal(np.asarray(colour.adjust_hue(img, factor)),
                                      np.asarray(TF.adjust_hue(img, factor)))


def test_the_jitter_is_torchvisions_colorjitter_in_the_drawn_order():
    """ColorJitter's forward: its four adjust_* of a PIL image in the permutation drawn. Bit for
    bit, and the order matters (two orders of the same factors differ)."""
    factors = np.array([1.3, 0.7, 1.15, 0.08])
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    results = []
    for order in (np.array([0, 1, 2, 3]), np.array([3, 2, 0, 1])):
        for img in _crops():
            ref = img
            for op in order:
                ref = ops[op](ref, float(factors[op]))
            ours = np.asarray(colour.jitter(img, factors, order))
            np.testing.assert_array_equal(ours, np.asarray(ref))
        results.append(np.asarray(colour.jitter(_crops()[0], factors, order)))  # the colour photo
    assert not np.array_equal(*results)


def test_byol_chains_the_references_ops_in_their_order():
    """DataAugmentationDINO's chain on one crop: jitter, grayscale (PIL's convert('L'), all three
    channels), DINO's PIL GaussianBlur(radius=sigma), ImageOps.solarize(128); each step only where
    drawn."""
    a = _photo()
    factors, order = np.array([0.8, 1.2, 0.9, -0.05]), np.array([2, 0, 3, 1])
    ref = TF.adjust_brightness(TF.adjust_saturation(Image.fromarray(a), 0.9), 0.8)
    ref = TF.adjust_contrast(TF.adjust_hue(ref, -0.05), 1.2)
    jittered = colour.byol(a, factors, order, False, None, False)
    np.testing.assert_array_equal(jittered, np.asarray(ref))
    grey = TF.rgb_to_grayscale(ref, num_output_channels=3)
    blurred = grey.filter(ImageFilter.GaussianBlur(radius=1.3))
    full = ImageOps.solarize(blurred, 128)
    np.testing.assert_array_equal(colour.byol(a, factors, order, True, 1.3, True), np.asarray(full))
    np.testing.assert_array_equal(colour.byol(a, None, order, False, None, True),
                                  np.asarray(ImageOps.solarize(Image.fromarray(a), 128)))


# ---- draws and crops ----

def test_the_draws_follow_the_recipes_probabilities():
    """Over 2,000 images (20,000 crops): jitter 0.8, grayscale 0.2, blur 1.0 / 0.1 / 0.5 on the
    first global, second global and local crops, solarise 0.2 on the second global only, flips
    0.5; the factors in ColorJitter(0.4, 0.4, 0.2, 0.1)'s ranges, sigma in 0.1..2 (each share
    within 3 standard errors)."""
    spec = MultiCrop()
    d = multicrop.image_draws(spec, [(375, 500)] * 2000, seed=3, first=0)
    fields = ("jitter", "grey", "blur", "solarize", "flips", "factors", "sigma")
    stack = {f: np.stack([getattr(x, f) for x in d]) for f in fields}

    def near(share, p, n):
        return abs(share - p) <= 3 * np.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-12

    assert near(stack["jitter"].mean(), 0.8, 20000) and near(stack["grey"].mean(), 0.2, 20000)
    assert near(stack["flips"].mean(), 0.5, 20000)
    for col, p in ((0, 1.0), (1, 0.1)):
        assert near(stack["blur"][:, col].mean(), p, 2000)
    assert near(stack["blur"][:, 2:].mean(), 0.5, 16000)
    assert near(stack["solarize"][:, 1].mean(), 0.2, 2000)
    assert not stack["solarize"][:, [0, 2, 3]].any()
    f = stack["factors"].reshape(-1, 4)
    assert (f.min(0) >= [0.6, 0.6, 0.8, -0.1]).all() and (f.max(0) <= [1.4, 1.4, 1.2, 0.1]).all()
    assert 0.1 <= stack["sigma"].min() and stack["sigma"].max() <= 2.0


def test_an_images_draws_are_a_function_of_the_seed_and_its_index():
    a = multicrop.image_draws(MultiCrop(), [(300, 400)] * 4, seed=1, first=10)
    b = multicrop.image_draws(MultiCrop(), [(300, 400)] * 2, seed=1, first=12)
    c = multicrop.image_draws(MultiCrop(), [(300, 400)], seed=2, first=12)
    np.testing.assert_array_equal(a[2].boxes, b[0].boxes)
    np.testing.assert_array_equal(a[3].factors, b[1].factors)
    assert not np.array_equal(a[2].boxes, c[0].boxes) and not np.array_equal(a[2].boxes, a[3].boxes)


@pytest.mark.parametrize("outs, k", [([200, 200, 200], 1), ([8, 8, 8], 2)])
def test_one_region_decode_gives_each_crops_own_pixels(outs, k):
    """A JPEG's crops from one decode of the region that holds them all, at the smallest scale any
    crop allows for its output side (1: one needs full scale; 2: the 16 px crop keeps 8 px at 1/2,
    not at 1/4), equal each crop decoded alone at that scale (jpeg_region.crop, which equals the
    whole image decoded at that scale and sliced)."""
    data = _jpeg(_photo(64, 96))
    boxes = np.array([[3, 5, 40, 50], [10, 30, 30, 60], [20, 2, 16, 20]])
    ours = multicrop.crops_of(Encoded(data), boxes, outs)
    for box, crop in zip(boxes, ours):
        assert torch.equal(crop, jpeg_region.crop(data, (64, 96), tuple(box), k)), box
    # 1/k of the box
    assert ours[0].shape[1:] == jpeg_region.scaled_box((3, 5, 40, 50), (64, 96), k)[2:]


def _views_per_image(views: multicrop.Views, n_locals: int) -> list[list[torch.Tensor]]:
    g, loc = views.globals_.pixels, views.locals_.pixels
    b = len(g) // 2
    return [[g[i], g[b + i], *(loc[v * b + i] for v in range(n_locals))] for i in range(b)]


def test_a_micro_batchs_crops_do_not_depend_on_how_the_batch_is_cut():
    """The transform of 6 images at indices 0..5 equals, image by image, its transform in
    micro-batches of 2 and 4 (first indices 0, 2, 4; 0 and 4): the draws are keyed by the index,
    not the batch."""
    images = [_decoded(_photo(40 + 4 * i, 56, i)) for i in range(6)]
    tf = multicrop.transform(TINY, seed=5)
    whole = _views_per_image(tf(images, 0), 2)
    for cut in ([0, 2, 4, 6], [0, 4, 6]):
        parts = [v for lo, hi in itertools.pairwise(cut)
                 for v in _views_per_image(tf(images[lo:hi], lo), 2)]
        assert all(torch.equal(a, b) for x, y in zip(whole, parts) for a, b in zip(x, y))


def test_the_views_are_view_major_and_each_crop_is_its_box_resized_and_flipped():
    """globals (2B, 3, S, S) and locals (nB, 3, s, s) uint8, view-major; with no colour op drawn,
    each crop is its box resized (torch's antialiased bicubic on uint8, augment.resample_uint8)
    and flipped as drawn. That resize against PIL's bicubic, the references': within 2 levels, 0.2
    on average."""
    images = [_decoded(_photo(48, 64, i)) for i in range(3)]
    spec = MultiCrop(32, (0.4, 1.0), 2, 16, (0.1, 0.4), 0.0, 0.0, (0.0, 0.0, 0.0), 0.0)
    views = multicrop.transform(spec, seed=0)(images, 7)
    assert views.globals_.pixels.shape == (6, 3, 32, 32)
    assert views.locals_.pixels.shape == (6, 3, 16, 16)
    d = multicrop.image_draws(spec, [(48, 64)] * 3, 0, 7)
    for i, img in enumerate(images):
        for v in range(4):
            crops, size = (views.globals_.pixels, 32) if v < 2 else (views.locals_.pixels, 16)
            t, left, h, w = d[i].boxes[v]
            box = img.x[:, t : t + h, left : left + w]
            want = augment.resample_uint8(box[None], size, "bicubic")[0]
            pil = Image.fromarray(box.permute(1, 2, 0).numpy()).resize((size, size), Image.BICUBIC)
            pil = torch.from_numpy(np.array(pil)).permute(2, 0, 1)
            flip = bool(d[i].flips[v])
            got = crops[(v % 2) * 3 + i]
            assert torch.equal(got, want.flip(-1) if flip else want), (i, v)
            diff = (got.int() - (pil.flip(-1) if flip else pil).int()).abs()
            assert diff.max() <= 2 and diff.float().mean() <= 0.2, (diff.max(), diff.float().mean())


# ---- the streams ----

def _jpeg_rows(bad: int | None = None) -> datasets.Dataset:
    """N JPEGs of 40-64 px whose label is their row; row `bad` holds bytes no decoder reads."""
    rows = [{"bytes": b"not an image" if i == bad else _jpeg(_photo(40 + i, 64 - i, i)),
             "path": None} for i in range(N)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": rows, "label": list(range(N))}, features=features)


def _mapped(ds, micro: int, accum: int = 1, rank: int = 0, world: int = 1, cache_mb: int = 0):
    cfg = DataConfig(num_workers=0, cache_mb=cache_mb)
    return batches.train_batches(ds, cfg, 32, micro, seed=4, rank=rank, world_size=world,
                                 accum=accum, views=TINY)


def _global_batches(streams_: list, steps: int) -> list[dict]:
    """Each step's images, {label: its four crops}, gathered from every stream's micro-batches."""
    out = []
    for _ in range(steps):
        images = {}
        for s, accum in streams_:
            for _ in range(accum):
                (g, loc), y = next(s)
                b = len(y)
                assert g.shape == (2 * b, 3, 32, 32) and loc.shape == (2 * b, 3, 16, 16)
                assert g.dtype == loc.dtype == torch.float32
                for i, label in enumerate(y.tolist()):
                    images[label] = [g[i], g[b + i], loc[i], loc[b + i]]
        out.append(images)
    return out


def test_one_process_accumulation_and_two_ranks_see_the_same_crops_of_each_image():
    """A global batch of 8 as one micro-batch, as 2 accumulated micro-batches of 4, and as 2 ranks
    of 4: the same images with the same crops, bit for bit (labels name the rows)."""
    ds = _jpeg_rows()
    one = _global_batches([(_mapped(ds, 8), 1)], 2)
    accumulated = _global_batches([(_mapped(ds, 4, accum=2), 2)], 2)
    ranks = _global_batches([(_mapped(ds, 4, rank=r, world=2), 1) for r in range(2)], 2)
    for a, b, c in zip(one, accumulated, ranks):
        assert sorted(a) == sorted(b) == sorted(c)
        assert all(torch.equal(x, y) and torch.equal(x, z)
                   for k in a for x, y, z in zip(a[k], b[k], c[k]))


def test_a_multicrop_stream_over_the_cache_gives_the_same_views():
    """Decoded once and cached (data.cache_mb) or decoded from its JPEG each time: the same
    crops."""
    ds = _jpeg_rows()
    (cached, _), (plain, _) = next(_mapped(ds, 4, cache_mb=64)), next(_mapped(ds, 4))
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


def test_an_image_that_does_not_decode_is_stood_in_for_in_a_multicrop_stream():
    ds = _jpeg_rows(bad=3)
    stream = _mapped(ds, 8)
    seen = []
    for _ in range(4):
        (g, loc), y = next(stream)
        assert len(y) == 8 and g.shape[0] == 16 and loc.shape[0] == 16
        seen += y.tolist()
    assert 3 not in seen and stream.skipped.rows


def test_the_streamed_multicrop_stream_yields_views_and_resumes_exactly():
    cfg = DataConfig(num_workers=0, streaming=True, shuffle_buffer=8)
    ids = _jpeg_rows().cast_column("image", datasets.Image(decode=False))
    ids = ids.to_iterable_dataset(num_shards=2)

    def make():
        return streams.stream_train_batches(ids, cfg, 32, 4, seed=1, views=TINY)

    s = make()
    first = [next(s) for _ in range(3)]
    (g, loc), y = first[0]
    assert g.shape == (8, 3, 32, 32) and loc.shape == (8, 3, 16, 16) and y.shape == (4,)
    assert -3 < float(g.min()) and float(g.max()) <= 1.0  # data.mean, data.std: [-1, 1]
    resumed = make()
    resumed.seek(2)
    (g2, loc2), y2 = next(resumed)
    (g3, loc3), y3 = first[2]
    assert torch.equal(g2, g3) and torch.equal(loc2, loc3) and torch.equal(y2, y3)


def test_multicrop_of_the_recipe_takes_the_dino_section_and_the_model_size():
    dino = DinoConfig(local_crops=6, local_crop_size=80, blur_prob=[1.0, 0.2, 0.4])
    spec = MultiCrop.of(dino, 160)
    assert (spec.global_size, spec.local_crops, spec.local_size) == (160, 6, 80)
    assert spec.blur_prob == (1.0, 0.2, 0.4)
    assert MultiCrop.of(DinoConfig(), 224) == MultiCrop()


def test_train_feed_passes_the_views_and_a_loader_worker_ships_them():
    """run.feed.train_feed(..., views=) gives the multi-crop stream; its batches from a loader
    worker (pickled Views, data.num_workers=1) equal those made in the process."""
    def first(workers: int):
        r = Recipe()
        r.model.img_size, r.run.seed = 32, 4
        r.data = DataConfig(num_workers=workers, cache_mb=0)
        make = feed.train_feed(r, _jpeg_rows(), views=TINY)
        return next(make(4, 1, Dist(0, 1, 0, torch.device("cpu"))))

    ((g0, l0), y0), ((g1, l1), y1) = first(0), first(1)
    assert g0.shape == (8, 3, 32, 32) and l0.shape == (8, 3, 16, 16)
    assert torch.equal(g0, g1) and torch.equal(l0, l1) and torch.equal(y0, y1)


def test_a_multicrop_stream_on_the_built_in_synthetic_data():
    """The built-in data (32 px PNGs): views of 32 and 16 px, normalised, labels as the split's."""
    ds = make_synthetic(SyntheticConfig(train_size=16, val_size=4, test_size=4), "train")
    stream = _mapped(ds, 8)
    (g, loc), y = next(stream)
    assert g.shape == (16, 3, 32, 32) and loc.shape == (16, 3, 16, 16) and y.shape == (8,)
    assert -1.0 <= float(g.min()) < float(g.max()) <= 1.0 and g.std() > 0.1
    assert set(y.tolist()) <= set(ds["label"])
