"""The inputs a build calibrates on and the gate compares on, read from one directory:
``.npy`` files (one batch of a one-input model each), ``.npz`` files (one array per input
name) or images.  Files alternate between calibration and held-out, so the gate never judges
a model on an input it was calibrated with.  Every file is checked once up front, then read
again each time it is used: a build holds one file's inputs at a time, not the whole set
(hundreds of decoded images would not fit a 4 GB board beside a running agent)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.modelbuild.request import BuildError, Feed, Preprocess

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
ARRAY_SUFFIXES = (".npy", ".npz")
MAX_FILES = 1000
MAX_FILE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 40_000_000  # far above a camera frame; a decompression bomb is refused
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
               "tensor(double)": np.float64, "tensor(int64)": np.int64,
               "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8,
               "tensor(bool)": np.bool_}


@dataclass(frozen=True)
class InputSpec:
    """One model input as ONNX Runtime reports it (``shape`` entries: int, or None for a
    symbolic dimension)."""

    name: str
    shape: tuple[int | None, ...]
    element_type: str

    @classmethod
    def of(cls, node: Any) -> InputSpec:
        return cls(node.name, tuple(d if isinstance(d, int) and d > 0 else None
                                    for d in node.shape), node.type)


@dataclass
class Feeds(Sequence[Feed]):
    """The inputs of some files, read from disk when asked for (the last file's kept, so an
    image and its mirror image decode once)."""

    files: list[Path]
    specs: Sequence[InputSpec]
    preprocess: Preprocess
    per_file: int  # 2 for images (the picture and its mirror image), 1 for arrays
    _last: tuple[int, list[Feed]] = field(default=(-1, []), repr=False)

    def __len__(self) -> int:
        return len(self.files) * self.per_file

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        number, view = divmod(index % len(self), self.per_file)
        if self._last[0] != number:
            self._last = (number, _read(self.files[number], self.specs, self.preprocess))
        return self._last[1][view]


@dataclass(frozen=True)
class Inputs:
    calibration: Feeds
    heldout: Feeds
    kind: str  # "images" or "arrays"


def load(directory: Path, specs: Sequence[InputSpec], preprocess: Preprocess) -> Inputs:
    """Every usable file of ``directory``, in name order, checked against the model's inputs;
    any file that does not fit is an error naming it (a calibration set is chosen, not
    scraped: a silently skipped file would change what the gate measured)."""
    try:
        files = sorted(p for p in directory.iterdir() if p.is_file()
                       and p.suffix.lower() in IMAGE_SUFFIXES + ARRAY_SUFFIXES)
    except OSError as error:
        raise BuildError(f"--calibration {directory}: {error.strerror or error}") from None
    if len(files) < 2:
        raise BuildError(f"--calibration {directory}: needs at least 2 files "
                         f"({', '.join(IMAGE_SUFFIXES + ARRAY_SUFFIXES)}), one to calibrate "
                         f"and one held out; found {len(files)}")
    if len(files) > MAX_FILES:
        raise BuildError(f"--calibration {directory}: {len(files)} files, at most {MAX_FILES}")
    kinds = {"images" if p.suffix.lower() in IMAGE_SUFFIXES else "arrays" for p in files}
    if len(kinds) > 1:
        raise BuildError(f"--calibration {directory}: mixes images and arrays; use one kind")
    kind = kinds.pop()
    for path in files:  # every error before any work, one file in memory at a time
        _read(path, specs, preprocess)
    per_file = 2 if kind == "images" else 1
    return Inputs(calibration=Feeds(files[0::2], specs, preprocess, per_file),
                  heldout=Feeds(files[1::2], specs, preprocess, per_file), kind=kind)


def _read(path: Path, specs: Sequence[InputSpec], preprocess: Preprocess) -> list[Feed]:
    try:
        size = path.stat().st_size
    except OSError as error:
        raise BuildError(f"{path}: {error.strerror or error}") from None
    if size > MAX_FILE_BYTES:
        raise BuildError(f"{path}: {size} bytes, at most {MAX_FILE_BYTES} per file")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return _image_feeds(path, specs, preprocess)
    return [_array_feed(path, specs)]


def _array_feed(path: Path, specs: Sequence[InputSpec]) -> Feed:
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                arrays = {key: loaded[key] for key in loaded.files}
        else:
            if len(specs) != 1:
                raise BuildError(f"{path}: the model has {len(specs)} inputs "
                                 f"({', '.join(s.name for s in specs)}); give .npz files "
                                 "with one array per input name")
            arrays = {specs[0].name: loaded}
    except BuildError:
        raise
    except (OSError, ValueError, EOFError) as error:
        raise BuildError(f"{path}: not a numpy array file ({error})") from None
    wanted = {s.name for s in specs}
    if set(arrays) != wanted:
        raise BuildError(f"{path}: holds {sorted(arrays)}; the model's inputs are "
                         f"{sorted(wanted)}")
    return {s.name: _fit(path, s, arrays[s.name]) for s in specs}


def _fit(path: Path, spec: InputSpec, array: np.ndarray) -> np.ndarray:
    dtype = NUMPY_TYPES.get(spec.element_type)
    if dtype is None:
        raise BuildError(f"{path}: input {spec.name} has type {spec.element_type}, which a "
                         "build cannot calibrate")
    if array.dtype != dtype and not (np.issubdtype(array.dtype, np.floating)
                                     and np.issubdtype(dtype, np.floating)):
        raise BuildError(f"{path}: input {spec.name} is {array.dtype}, the model wants "
                         f"{np.dtype(dtype).name}")
    if array.ndim != len(spec.shape) or any(
            want is not None and have != want
            for have, want in zip(array.shape, spec.shape, strict=True)):
        shown = "x".join("?" if d is None else str(d) for d in spec.shape)
        raise BuildError(f"{path}: input {spec.name} has shape "
                         f"{'x'.join(map(str, array.shape))}, the model wants {shown}")
    if array.size and np.issubdtype(array.dtype, np.floating) \
            and not bool(np.isfinite(array).all()):
        raise BuildError(f"{path}: input {spec.name} holds NaN or infinity")
    return np.ascontiguousarray(array, dtype=dtype)


def image_layout(spec: InputSpec) -> tuple[str, int, int]:
    """("nchw" | "nhwc", height, width) of a 4-D three-channel input, else a BuildError."""
    shape = spec.shape
    if len(shape) == 4 and shape[1] == 3 and shape[2] and shape[3]:
        return "nchw", shape[2], shape[3]
    if len(shape) == 4 and shape[3] == 3 and shape[1] and shape[2]:
        return "nhwc", shape[1], shape[2]
    shown = "x".join("?" if d is None else str(d) for d in shape)
    raise BuildError(f"images need a model whose input is NCHW or NHWC with 3 channels and a "
                     f"fixed height and width; {spec.name} is {shown} (give .npy inputs)")


def _image_feeds(path: Path, specs: Sequence[InputSpec], preprocess: Preprocess) -> list[Feed]:
    """The image and its mirror image: two inputs from one picture, both on the same side
    of the calibration / held-out split."""
    from PIL import Image, UnidentifiedImageError

    if len(specs) != 1:
        raise BuildError(f"{path}: images need a one-input model; this one has "
                         f"{len(specs)} ({', '.join(s.name for s in specs)})")
    spec = specs[0]
    layout, height, width = image_layout(spec)
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise BuildError(f"{path}: not a readable image ({error})") from None
    pixels = np.asarray(rgb, dtype=np.float32)
    if preprocess.order == "bgr":
        pixels = pixels[:, :, ::-1]
    mean = np.asarray(preprocess.mean, np.float32)
    std = np.asarray(preprocess.std, np.float32)
    normalised: np.ndarray = np.subtract(pixels, mean) / std
    feeds = []
    for view in (normalised, normalised[:, ::-1, :]):
        array = view.transpose(2, 0, 1) if layout == "nchw" else view
        feeds.append({spec.name: _fit(path, spec, array[None])})
    return feeds
