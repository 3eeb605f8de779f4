"""Images: real photographs for demos, calibration and benchmarks, and image lists as
batches.

Data sets cannot be downloaded here, so the photographs come from the ones that
scikit-image ships inside its package (no network access needed).
"""

from __future__ import annotations

import torch

# RGB photographs bundled with scikit-image; busy scenes first.
_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "retina", "hubble_deep_field")


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


def as_batch(images) -> torch.Tensor:
    """A batch [B, 3, H, W] as is, or a list of images [3, H, W] stacked into one. One
    image becomes a view, not a copy: a detector called per image pays no extra kernel."""
    if isinstance(images, torch.Tensor) and images.dim() == 4:
        return images
    images = list(images)
    return images[0].unsqueeze(0) if len(images) == 1 else torch.stack(images)
