"""Datasets, pipelines and samplers, on real files."""

from __future__ import annotations

import os

import albumentations as A
import cv2
import numpy as np
import pytest
import torch

from core.config import DataConfig
from core.errors import UserError
from data.datasets import DummyDataset, ImageFolderDataset, PackedStrings, read_image
from data.digits import VAL_SIZE, export_digits
from data.loader import EpochSampler, ShardSampler, build_datasets, collate_channels_last
from data.transforms import DeviceNormalize, eval_transform, train_transform
from tests.helpers import make_image_folder, png_header, write_jpeg


def test_packed_strings_round_trip():
    strings = ["a/b.png", "", "ünïcödé/ф.jpg", "x" * 300, os.fsdecode(b"caf\xe9/\xff.png")]  # not UTF-8
    packed = PackedStrings(strings)
    assert [packed[i] for i in range(len(packed))] == strings
    assert packed.data.dtype == np.uint8 and packed.offsets.dtype == np.int64


def test_imagefolder_reads_gray_rgba_and_jpeg(tmp_path):
    root = make_image_folder(tmp_path, {"train": {"cat": 2, "dog": 3}, "val": {"cat": 1, "dog": 1}})
    cv2.imwrite(str(root / "train/cat/gray.png"), np.full((20, 30), 128, np.uint8))
    cv2.imwrite(str(root / "train/cat/rgba.png"), np.full((20, 30, 4), 200, np.uint8))
    cv2.imwrite(str(root / "train/dog/photo.jpg"), np.full((40, 30, 3), 50, np.uint8))
    (root / "train/dog/notes.txt").write_text("not an image")
    cfg = DataConfig(name="imagefolder", root=str(root), img_size=16, augment=False)
    train, val = build_datasets(cfg, seed=0)
    assert train.classes == ["cat", "dog"] and len(train) == 8 and len(val) == 2
    assert list(train.labels) == [0, 0, 0, 0, 1, 1, 1, 1]
    for i in range(len(train)):
        image, label = train[i]
        assert image.shape == (3, 16, 16) and image.dtype == torch.uint8


def test_imagefolder_errors_name_the_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ImageFolderDataset(tmp_path / "missing", eval_transform(DataConfig()), 0)
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(UserError, match="has no class folders"):
        ImageFolderDataset(tmp_path / "empty_root", eval_transform(DataConfig()), 0)
    root = make_image_folder(tmp_path / "mismatch", {"train": {"a": 1, "b": 1}, "val": {"a": 1, "c": 1}})
    with pytest.raises(UserError, match=f"{root}/val has classes that are not among the 2 training classes \\(c\\)"):
        build_datasets(DataConfig(name="imagefolder", root=str(root)), seed=0)


def test_val_lacking_training_classes_and_empty_class_folders_are_warnings(tmp_path, caplog):
    """The class map is the training split's: a val split without some classes keeps their indices."""
    root = make_image_folder(tmp_path, {"train": {"a": 2, "b": 2, "c": 2, "d": 1}, "val": {"a": 1, "c": 2}})
    (root / "train/d/000.png").unlink()  # an empty class folder
    train, val = build_datasets(DataConfig(name="imagefolder", root=str(root), img_size=8), seed=0)
    assert train.classes == val.classes == ["a", "b", "c", "d"]
    assert train.labels.tolist() == [0, 0, 1, 1, 2, 2] and val.labels.tolist() == [0, 2, 2]
    assert f"{root}/train has no images of 1 class(es): d" in caplog.text
    assert f"{root}/val has no images of 2 class(es): b, d" in caplog.text


def test_split_names_are_configurable(tmp_path):
    root = make_image_folder(tmp_path, {"train": {"a": 2, "b": 1}, "test": {"a": 1, "b": 1}})
    cfg = DataConfig(name="imagefolder", root=str(root), val_split="test", img_size=8)
    train, test = build_datasets(cfg, seed=0)
    assert (len(train), len(test)) == (3, 2) and test.path(0) == f"{root}/test/a/000.png"


def test_corrupt_image_names_the_file(tmp_path):
    root = make_image_folder(tmp_path, {"train": {"a": 1}})
    (root / "train/a/broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    dataset = ImageFolderDataset(root / "train", eval_transform(DataConfig(img_size=8)), 0)
    with pytest.raises(UserError, match="broken.png"):
        dataset[1]


def test_truncated_jpeg_and_png_are_unreadable(tmp_path):
    """OpenCV decodes a cut JPEG as grey and only prints a warning: the end marker must follow the scan data."""
    whole = write_jpeg(tmp_path / "whole.jpg")
    assert read_image(str(tmp_path / "whole.jpg")).shape == (64, 64, 3)
    cut = {"third.jpg": whole[:len(whole) // 3], "no-end-marker.jpg": whole[:-2],
           # a marker segment before the scan holding FF D9 (as an EXIF thumbnail does) is not the end marker
           "thumbnail.jpg": whole[:2] + b"\xff\xfe\x00\x06\xff\xd9\xff\xd9" + whole[2:len(whole) // 2]}
    cv2.imwrite(str(tmp_path / "whole.png"), np.full((20, 30, 3), 7, np.uint8))
    png = (tmp_path / "whole.png").read_bytes()
    cut["no-iend.png"] = png[:-12]
    cut["empty.png"] = b""
    cut["junk.png"] = b"\x89PNG\r\n\x1a\n not an image"  # (bytes 16-24 are no size: not "1768776039x101 pixels")
    for name, data in cut.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match=f"cannot read image {tmp_path / name} "):
            read_image(str(tmp_path / name))
    padded = {"zeros.jpg": whole + b"\0" * 100, "appended.jpg": whole + b"trailing data after the end marker",
              "appended.png": png + b"\0\n"}
    for name, data in padded.items():
        (tmp_path / name).write_bytes(data)
        assert read_image(str(tmp_path / name)).shape[2] == 3, name


def test_images_over_max_pixels_are_refused_before_decoding(tmp_path):
    (tmp_path / "bomb.png").write_bytes(png_header(40000, 40000))  # 200 MB of pixels claimed by ~100 bytes
    with pytest.raises(UserError, match=r"bomb.png is 40000x40000 pixels, more than data.max_image_pixels=89478485"):
        read_image(str(tmp_path / "bomb.png"))
    image = np.full((20, 30, 3), 9, np.uint8)
    for name in ("a.png", "a.jpg", "a.bmp", "a.webp", "a.tif"):  # our header parsers, then PIL's for the others
        cv2.imwrite(str(tmp_path / name), image)
        with pytest.raises(UserError, match=f"{name} is 30x20 pixels, more than data.max_image_pixels=599"):
            read_image(str(tmp_path / name), max_pixels=599)
        assert read_image(str(tmp_path / name), max_pixels=600).shape == (20, 30, 3)
    # A format neither our parsers nor PIL read (Radiance HDR) is left to OpenCV, whose own refusal is one line.
    (tmp_path / "radiance.png").write_bytes(b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n-Y 40000 +X 40000\n" + b"\0" * 64)
    with pytest.raises(UserError, match="cannot decode image .*radiance.png .OpenCV: pixels <= CV_IO_MAX_IMAGE_PIXELS"):
        read_image(str(tmp_path / "radiance.png"))


def test_broken_symlinks_are_named_and_skipped_only_in_training(tmp_path, caplog):
    root = make_image_folder(tmp_path, {"train": {"a": 2}, "val": {"a": 2}})
    os.symlink("nowhere.png", root / "train/a/gone.png")
    transform = eval_transform(DataConfig(img_size=8))
    with pytest.raises(UserError, match=f"{root}/train/a/gone.png is a broken symbolic link .*data.skip_corrupt"):
        ImageFolderDataset(root / "train", transform, 0)
    assert len(ImageFolderDataset(root / "train", transform, 0, skip_corrupt=True)) == 2
    assert f"{root}/train/a/gone.png is a broken symbolic link" in caplog.text


def test_images_below_a_class_folder_count_as_torchvision_counts_them(tmp_path):
    """train/a/2019/*.png trained as if absent (issue 51 item 4): torchvision's ImageFolder walks each class folder
    at every depth; the same tree gives the same (path, label) list, in its order ('-' sorts before '/')."""
    import shutil

    from torchvision.datasets import ImageFolder

    root = make_image_folder(tmp_path, {"train": {"a": 3, "b": 2}})
    for sub, count in (("a/2019", 2), ("a/2019/deep", 1), ("a/2019-b", 1), ("b/x", 1)):
        (root / "train" / sub).mkdir()
        for i in range(count):
            shutil.copy(root / "train/a/000.png", root / "train" / sub / f"{i:03d}.png")
    dataset = ImageFolderDataset(root / "train", eval_transform(DataConfig(img_size=8)), 0)
    assert len(dataset) == 10 and dataset.labels.tolist().count(0) == 7
    ours = [(dataset.path(i), int(label)) for i, label in enumerate(dataset.labels)]
    assert ours == ImageFolder(str(root / "train")).samples
    os.symlink("nowhere.png", root / "train/a/2019/gone.png")  # a broken link below the first level is named too
    with pytest.raises(UserError, match=f"{root}/train/a/2019/gone.png is a broken symbolic link"):
        ImageFolderDataset(root / "train", eval_transform(DataConfig(img_size=8)), 0)


def test_augmentation_is_seeded_by_seed_epoch_index():
    cfg = DataConfig(img_size=24)
    data = DummyDataset(8, 4, 40, train_transform(cfg), seed=3)
    same = DummyDataset(8, 4, 40, train_transform(cfg), seed=3)
    assert torch.equal(data[(0, 5)][0], same[(0, 5)][0])  # reproducible from the seed
    assert not torch.equal(data[(0, 5)][0], data[(1, 5)][0])  # new augmentation each epoch
    assert not torch.equal(data[(0, 5)][0], DummyDataset(8, 4, 40, train_transform(cfg), seed=4)[(0, 5)][0])
    fixed = DummyDataset(8, 4, 40, train_transform(DataConfig(img_size=24, augment=False)), seed=3)
    assert torch.equal(fixed[(0, 5)][0], fixed[(1, 5)][0])  # augment=false: deterministic


def test_dummy_is_deterministic_and_learnable():
    data = DummyDataset(200, 4, 16, eval_transform(DataConfig(img_size=16, crop_pct=1.0)), seed=0)
    images = torch.stack([data[i][0] for i in range(200)]).flatten(1).float()
    labels = torch.tensor(data.labels)
    assert torch.equal(images[7], data[7][0].flatten())
    # A nearest-class-mean classifier on half the data already separates the classes.
    means = torch.stack([images[:100][labels[:100] == c].mean(0) for c in range(4)])
    predicted = torch.cdist(images[100:], means).argmin(1)
    assert (predicted == labels[100:]).float().mean() > 0.9
    val = DummyDataset(10, 4, 16, data.transform, seed=0, offset=200)
    assert not torch.equal(val[0][0], data[0][0])


def test_digits_export_is_stratified_and_cached(tmp_path):
    root = export_digits(tmp_path / "digits")
    cfg = DataConfig(name="digits", root=str(root), img_size=32)
    train, val = build_datasets(cfg, seed=0)
    assert len(val) == VAL_SIZE and len(train) + len(val) == 1797
    assert train.classes == [str(d) for d in range(10)]
    counts = np.bincount(val.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # stratified: about 36 per digit
    image = cv2.imread(train.path(0), cv2.IMREAD_UNCHANGED)
    assert image.shape == (32, 32)  # stored grayscale, read as RGB
    mtime = (root / "train").stat().st_mtime_ns
    export_digits(root)
    assert (root / "train").stat().st_mtime_ns == mtime  # second call reuses the cache
    with pytest.raises(UserError, match=r"holds the digits exported at 32 px, not 64 px; choose another folder"):
        export_digits(root, 64)  # an export of another size was silently reused as this one


def test_train_sampler_covers_each_index_once_and_reshuffles():
    n, world = 103, 2
    samplers = [EpochSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=5, drop_last=True)
                for r in range(world)]
    epochs = []
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        keys = [k for s in samplers for k in s]
        assert all(e == epoch for e, _ in keys)
        indices = [i for _, i in keys]
        assert len(indices) == len(set(indices)) == n // world * world  # drop_last drops the odd one
        epochs.append([i for _, i in samplers[0]])
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_sampler_counts_each_index_once(world):
    n = 361
    indices = [i for r in range(world) for i in ShardSampler(n, r, world)]
    assert indices == list(range(n))


def test_digits_never_touches_a_foreign_folder(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(UserError, match="is not empty and holds no digits export"):
        export_digits(photos)
    assert (photos / "holiday.jpg").read_bytes() == b"precious"
    (tmp_path / "empty").mkdir()
    assert (export_digits(tmp_path / "empty") / "val").is_dir()  # an empty folder is fine


@pytest.mark.parametrize("channels_last", [True, False])
def test_device_normalize_matches_albumentations_normalize(channels_last):
    cfg = DataConfig(img_size=24)
    dataset = DummyDataset(8, 4, 40, train_transform(cfg), seed=0)
    images, _ = collate_channels_last([dataset[(0, i)] for i in range(8)])
    assert images.dtype == torch.uint8  # workers ship uint8: a quarter of the bytes of float32
    normalized = DeviceNormalize(cfg.mean, cfg.std, torch.device("cpu"), channels_last)(images)
    reference = A.Normalize(mean=cfg.mean, std=cfg.std, max_pixel_value=255.0)
    want = torch.stack([torch.from_numpy(reference(image=image.permute(1, 2, 0).numpy())["image"]).permute(2, 0, 1)
                        for image in images])
    assert normalized.dtype == torch.float32
    assert normalized.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(normalized, want, rtol=0, atol=1e-5)


def test_a_root_of_class_folders_without_splits_is_told_about_val_fraction(tmp_path):
    """Issue 61: one folder per class and no train/ (the Keras/fastai layout) is refused in one line that names
    data.val_fraction; a root of splits missing one keeps the layout's own advice."""
    root = make_image_folder(tmp_path, {"photos": {"cat": 2, "dog": 2}}, size=8) / "photos"
    with pytest.raises(UserError) as err:
        build_datasets(DataConfig(name="imagefolder", root=str(root), img_size=8), seed=0)
    assert str(err.value) == (f"data folder {root}/train does not exist; {root} holds folders (cat, dog) but no such "
                              "split: if they are the classes, add data.val_fraction=0.2 (a stratified validation "
                              "split made for you, docs/data.md); else name the splits with data.train_split and "
                              "data.val_split")
    splits = make_image_folder(tmp_path / "splits", {"train": {"cat": 2}}, size=8)
    with pytest.raises(UserError, match="val does not exist; expected <data.root>/<split>/<class>/"):
        build_datasets(DataConfig(name="imagefolder", root=str(splits), img_size=8), seed=0)


def test_an_unreadable_training_image_names_data_skip_corrupt(tmp_path):
    """Issue 61: a corrupt training JPEG met mid-epoch stops the run in one line that names data.skip_corrupt (which
    skips it); validation never skips, so its line does not offer it."""
    root = make_image_folder(tmp_path, {"train": {"cat": 2}, "val": {"cat": 1}}, size=8)
    for split in ("train", "val"):
        data = write_jpeg(root / split / "cat" / "z.jpg", size=32)
        (root / split / "cat" / "z.jpg").write_bytes(data[: len(data) // 2])  # cut short: no end marker
    train, val = build_datasets(DataConfig(name="imagefolder", root=str(root), img_size=8), seed=0)
    with pytest.raises(UserError) as err:
        train[(0, 2)]
    assert str(err.value) == (f"cannot read image {root}/train/cat/z.jpg (corrupt, truncated or not an image); "
                              "remove or replace it; or set data.skip_corrupt=true to drop unreadable training "
                              "images (counted each epoch)")
    with pytest.raises(UserError) as err:
        val[1]
    assert "skip_corrupt" not in str(err.value)
