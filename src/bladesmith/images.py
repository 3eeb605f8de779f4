"""Images: real photographs for demos, calibration and benchmarks, and image lists as
batches.

Data sets cannot be downloaded here, so the photographs come from the ones that
scikit-image ships inside its package (no network access needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# RGB photographs bundled with scikit-image; busy scenes first.
_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "retina", "hubble_deep_field")
# Those whose views a detector tells apart: a star field looks alike at every scale.
_VIEWED = _PHOTOS[:5]


def photo(name: str = "astronaut") -> torch.Tensor:
    """One bundled photograph as a float tensor [3, H, W] in [0, 1]."""
    import skimage.data

    if name not in _PHOTOS:
        raise ValueError(f"photo name must be one of {', '.join(_PHOTOS)}; got {name!r}")
    array = getattr(skimage.data, name)()
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)


def sample_images(
    batch_size: int,
    image_size: tuple[int, int],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A batch [B, 3, H, W] of real photographs resized to ``image_size`` (h, w).

    The photographs repeat when the batch is larger than the collection.
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0; got {batch_size}")
    height, width = image_size
    images = [
        torch.nn.functional.interpolate(
            photo(_PHOTOS[i % len(_PHOTOS)])[None],
            size=(height, width),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )[0].clamp_(0.0, 1.0)
        for i in range(batch_size)
    ]
    if not images:
        return torch.empty(0, 3, height, width, device=device, dtype=dtype)
    return torch.stack(images).to(device=device, dtype=dtype)


def varied_photos(
    count: int, image_size: tuple[int, int], seed: int = 0, first: int = 0
) -> torch.Tensor:
    """A batch [count, 3, H, W] of distinct views of the bundled photographs, so that a
    detector's answers differ from view to view (random pixels give nearly the same
    detections whatever the pixels). View i shows photograph i (cycling; all but the
    star field), mirrored on every other round of them, scaled over ``image_size`` (h, w)
    by a factor in [1, 1.5] and cropped at a random place. Views of one photograph and
    mirroring take evenly spaced factors, at least 1/12 of the range apart for up to 120
    views: each object's box differs in size between them, so no two are near copies
    (drawn independently, two views could be). ``first``: only the views from that
    one on (those before it are drawn, not made)."""
    generator = torch.Generator().manual_seed(seed)
    height, width = image_size
    pairs = 2 * len(_VIEWED)  # (photograph, mirrored or not)
    steps = max(-(-count // pairs), 1)  # views of each pair, at most
    offset = float(torch.rand((), generator=generator))  # where the factors start
    views = []
    for i in range(count):
        scale = 1.0 + 0.5 * (i // pairs + offset) / steps
        size = (round(height * scale), round(width * scale))
        top = int(torch.randint(size[0] - height + 1, (), generator=generator))
        left = int(torch.randint(size[1] - width + 1, (), generator=generator))
        if i < first:
            continue
        source = photo(_VIEWED[i % len(_VIEWED)])[None]
        scaled = F.interpolate(source, size=size, mode="bilinear", antialias=True)[0]
        view = scaled[:, top : top + height, left : left + width]
        if (i // len(_VIEWED)) % 2:
            view = view.flip(-1)
        views.append(view.clamp(0.0, 1.0))
    return torch.stack(views) if views else torch.empty(0, 3, height, width)


def as_batch(images) -> torch.Tensor:
    """A batch [B, 3, H, W] as is, or a list of images [3, H, W] stacked into one. One
    image becomes a view, not a copy: a detector called per image pays no extra kernel."""
    if isinstance(images, torch.Tensor) and images.dim() == 4:
        return images
    images = list(images)
    return images[0].unsqueeze(0) if len(images) == 1 else torch.stack(images)
