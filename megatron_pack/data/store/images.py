"""The image columns of a token store (only in a store whose records hold images; a text store has none).

Files (``N`` samples, ``M`` images in order of appearance, sample after sample)::

    image_offsets.npy      int64  [N+1]  sample i's images are images[image_offsets[i]:image_offsets[i+1]]
    image_token_start.npy  int64  [M]    first <|image_pad|> of each image, counted from its sample's first id
    image_grid_thw.npy     int32  [3M]   (t, h, w) patch grid of each image, row after row
    image_ref_kind.npy     uint8  [M]    0: a file (image_ref_bytes holds its absolute path, UTF-8), 1: stored bytes
    image_ref_offsets.npy  int64  [M+1]  image j's reference is image_ref_bytes[image_ref_offsets[j]:...[j+1]]
    image_ref_bytes.npy    uint8  [R]    the paths and stored image files, back to back
    image_sha256.npy       uint8  [32M]  sha256 of each image file's bytes, checked when the loader reads it

Every image counts ``t*h*w / merge_size**2`` ids in its sample (the expanded placeholders), so plans,
budgets, balance and reports see them as tokens. The store's ``metadata.json`` describes these under
``images`` (the processor's resize rule, the vision token ids, the counts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_ARRAYS = ("image_offsets", "image_token_start", "image_grid_thw", "image_ref_kind", "image_ref_offsets",
                "image_ref_bytes", "image_sha256")
_DTYPES = {"image_offsets": np.int64, "image_token_start": np.int64, "image_grid_thw": np.int32,
           "image_ref_kind": np.uint8, "image_ref_offsets": np.int64, "image_ref_bytes": np.uint8,
           "image_sha256": np.uint8}
PATH, STORED = 0, 1


class ImageWriter:
    """Appends the images of each stored sample (``None`` or ``(infos, starts)`` per sample)."""

    def __init__(self, out_dir: Path, appender):
        self.out_dir = Path(out_dir)
        self.files = {name: appender(self.out_dir / f"{name}.npy", _DTYPES[name]) for name in IMAGE_ARRAYS}
        self.files["image_offsets"].append([0])
        self.files["image_ref_offsets"].append([0])
        self.num_images, self.num_image_tokens, self.num_ref_bytes, self.num_with_images = 0, 0, 0, 0

    def append(self, samples: list) -> None:
        counts = []
        for images in samples:
            counts.append(0 if images is None else len(images[0]))
            if images is not None:
                self._append_images(*images)
        self.files["image_offsets"].append(self.num_images - sum(counts) + np.cumsum(counts))

    def _append_images(self, infos, starts) -> None:
        self.num_with_images += 1
        refs = [i.ref.data if i.ref.data is not None else i.ref.path.encode("utf-8") for i in infos]
        self.files["image_token_start"].append(starts)
        self.files["image_grid_thw"].append(np.array([i.grid for i in infos], dtype=np.int32).reshape(-1))
        self.files["image_ref_kind"].append([STORED if i.ref.data is not None else PATH for i in infos])
        self.files["image_ref_bytes"].append(np.frombuffer(b"".join(refs), dtype=np.uint8))
        self.files["image_ref_offsets"].append(self.num_ref_bytes + np.cumsum([len(r) for r in refs]))
        self.files["image_sha256"].append(np.frombuffer(b"".join(i.sha256 for i in infos), dtype=np.uint8))
        self.num_images += len(infos)
        self.num_image_tokens += sum(i.num_tokens for i in infos)
        self.num_ref_bytes += sum(len(r) for r in refs)

    def close(self) -> dict:
        """Close the files (removed again when no record held an image) and return the counts."""
        for f in self.files.values():
            f.close()
        if self.num_images == 0:
            for name in IMAGE_ARRAYS:
                (self.out_dir / f"{name}.npy").unlink()
            return {}
        return {"num_images": self.num_images, "num_image_tokens": self.num_image_tokens,
                "num_samples_with_images": self.num_with_images}


class StoreImages:
    """Read-only view of a store's image columns."""

    def __init__(self, path: Path, merge_size: int):
        self.merge_size = merge_size
        load = lambda name: np.load(Path(path) / f"{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        self.offsets, self.token_start = load("image_offsets"), load("image_token_start")
        self.grid = load("image_grid_thw")
        self.kind, self.ref_offsets, self.ref_bytes = load("image_ref_kind"), load("image_ref_offsets"), \
            load("image_ref_bytes")
        self.sha256 = load("image_sha256")

    def sample(self, i: int) -> list[dict]:
        """Sample ``i``'s images: ``{"start", "grid" (t, h, w), "path" or "data", "sha256" (hex)}`` each."""
        return [self.image(j) for j in range(int(self.offsets[i]), int(self.offsets[i + 1]))]

    def sample_images(self, i: int, num_ids: int) -> list[dict]:
        """The images of sample ``i`` read as its first ``num_ids`` ids (a truncated sample keeps the images whose
        pads all lie in its tokens ``ids[:num_ids - 1]``; the plan never cuts one)."""
        out = []
        for image in self.sample(i):
            t, h, w = image["grid"]
            if image["start"] + t * h * w // self.merge_size ** 2 <= num_ids - 1:
                out.append(image)
        return out

    def image(self, j: int) -> dict:
        ref = bytes(self.ref_bytes[int(self.ref_offsets[j]):int(self.ref_offsets[j + 1])])
        out = {"start": int(self.token_start[j]), "grid": tuple(int(x) for x in self.grid[3 * j:3 * j + 3]),
               "sha256": bytes(self.sha256[32 * j:32 * j + 32]).hex()}
        if int(self.kind[j]) == STORED:
            out["data"] = ref
        else:
            out["path"] = ref.decode("utf-8")
        return out


def changed_images(images: StoreImages, samples, spec: dict, where) -> tuple[list[str], int]:
    """``(the first few problems, how many)`` of the image files ``samples`` use: missing, not an image, or of a
    pixel size the processor's rule (``spec``: the store's ``images`` metadata) cuts into another patch grid than
    the one prepare recorded. Reads each file's header only (no decoding, no checksum: the loader checks every
    image's sha256 when it reads it). ``where(i)`` names sample ``i``'s record."""
    from PIL import Image, UnidentifiedImageError

    from megatron_pack.data.formats.images import smart_resize

    samples = np.unique(np.asarray(samples, dtype=np.int64))
    starts, stops = np.asarray(images.offsets)[samples], np.asarray(images.offsets)[samples + 1]
    patch, factor = int(spec["patch_size"]), int(spec["patch_size"]) * int(spec["merge_size"])
    problems, count = [], 0
    for i, lo, hi in zip(samples[stops > starts].tolist(), starts[stops > starts].tolist(), stops[stops > starts].tolist()):
        for k, j in enumerate(range(lo, hi)):
            if int(images.kind[j]) != PATH:  # stored bytes: checked with the store's own checksums
                continue
            image = images.image(j)
            try:
                with Image.open(image["path"]) as opened:
                    width, height = opened.size
                h, w = smart_resize(height, width, factor, int(spec["min_pixels"]), int(spec["max_pixels"]))
                if (1, h // patch, w // patch) == image["grid"]:
                    continue
                why = f"has {width}x{height} pixels, which is not the size prepare recorded (patch grid {image['grid']})"
            except FileNotFoundError:
                why = "is missing"
            except (OSError, UnidentifiedImageError, ValueError) as exc:
                why = f"cannot be read as an image ({exc})"
            count += 1
            if len(problems) < 3:
                problems.append(f"sample {i} ({where(i)}): image {k} {image['path']} {why}")
    return problems, count
