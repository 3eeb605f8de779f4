"""Run as a script: a device with no native kernels (PrivateUse1, as DirectML registers),
made of Python, on which the operators must run through their copy-to-CPU fallback.

Registering a backend cannot be undone, hence a process of its own (test_fallback.py).
"""

import torch
from ops_testing import make_decode_inputs
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

import bladesmith.ops as ops

DEVICE = "privateuseone"


class DeviceTensor(torch.Tensor):
    """A PrivateUse1 tensor whose data is a CPU tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data):
        tensor = torch._C._acc.create_empty_tensor(data.shape, data.dtype)
        tensor.__class__ = cls
        return tensor

    def __init__(self, data):
        self.cpu_data = data


def register_device() -> None:
    _setup_privateuseone_for_python_backend()

    def impl(name):
        return torch.library.impl(f"aten::{name}", DEVICE)

    @impl("empty_strided")
    def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
        return DeviceTensor(torch.empty(size, dtype=dtype or torch.float32))

    @impl("empty.memory_format")
    def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return DeviceTensor(torch.empty(size, dtype=dtype or torch.float32))

    @impl("_copy_from")
    def copy_from(src, dst, non_blocking=False):
        data = src.cpu_data if isinstance(src, DeviceTensor) else src
        if isinstance(dst, DeviceTensor):
            dst.cpu_data = data.clone()
        else:
            dst.copy_(data)
        return dst


def main() -> None:
    ops.load_library()
    register_device()
    inputs = make_decode_inputs(51, 2, [30, 8], 3, logit_mean=0.0, per_image_anchors=True)
    on_device = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}
    args = dict(score_threshold=0.2, topk_candidates=12)
    nms_args = dict(iou_threshold=0.5, max_detections=10)
    decoded = ops.retinanet_decode(**inputs, **args)
    calls = [
        (ops.retinanet_decode(**on_device, **args), decoded),
        (
            ops.batched_nms(*(t.to(DEVICE) for t in decoded), **nms_args),
            ops.batched_nms(*decoded, **nms_args),
        ),
        (
            ops.retinanet_postprocess(**on_device, **args, **nms_args),
            ops.retinanet_postprocess(**inputs, **args, **nms_args),
        ),
    ]
    for outputs, expected in calls:
        assert all(t.device.type == DEVICE for t in outputs)
        assert all(torch.equal(t.to("cpu"), e) for t, e in zip(outputs, expected))

    mixed = {**on_device, "image_sizes": inputs["image_sizes"]}
    try:
        ops.retinanet_decode(**mixed, **args)
    except ValueError as error:
        assert str(error).startswith("image_sizes: expected device privateuseone:0"), error
    else:
        raise AssertionError("tensors on two devices were accepted")
    print("ok")


if __name__ == "__main__":
    main()
