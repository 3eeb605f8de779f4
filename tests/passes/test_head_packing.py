"""head_packing on the GPU: half precision in a CUDA graph keeps the detections."""

from __future__ import annotations

from bladesmith.passes.channels_last import ChannelsLast
from bladesmith.passes.cuda_graph import CudaGraph
from bladesmith.passes.precision import Float16
from bladesmith.verify import compare_detections
from engine_testing import (
    cuda,
    detections_through,
)


@cuda
def test_head_packing_in_half_precision_in_a_cuda_graph_keeps_the_detections(retinanet, photos):
    from bladesmith.passes.head_packing import HeadPacking

    plain, packed = detections_through(
        retinanet,
        photos,
        (Float16(), ChannelsLast(), CudaGraph()),
        (HeadPacking(), Float16(), ChannelsLast(), CudaGraph()),
    )
    assert compare_detections(plain, packed, score_atol=1.1e-2).passed
