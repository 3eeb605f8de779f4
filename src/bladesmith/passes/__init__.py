"""bladesmith's passes: transforms of a candidate, one module each, run in ``ORDER``.

Adapt the model first (fixed shapes, the head over all levels at once), then change its
arithmetic (precision, convolution algorithm, memory format), then build what runs it
(Inductor and a CUDA graph on the GPU; TorchScript, ONNX Runtime or OpenVINO on the CPU). A
TorchScript model is frozen before cuDNN's autotuning and the CUDA graph wrap it. FP8
rewrites the module after Inductor, since it pays only compiled, and compiles it again.
"""

from bladesmith.passes.candidate import Candidate
from bladesmith.passes.channel_padding import ChannelPadding
from bladesmith.passes.channels_last import ChannelsLast
from bladesmith.passes.conv_fusion import ConvFusion
from bladesmith.passes.cuda_graph import CudaGraph
from bladesmith.passes.cudnn_benchmark import CudnnBenchmark
from bladesmith.passes.fixed_shape import FixedShape
from bladesmith.passes.float8 import Float8, Float8Mixed, Float8Static
from bladesmith.passes.head_packing import HeadPacking
from bladesmith.passes.inductor import Inductor
from bladesmith.passes.norm_folding import NormFolding
from bladesmith.passes.onnxruntime import OnnxRuntime
from bladesmith.passes.openvino import OpenVino, OpenVinoF32
from bladesmith.passes.openvino_int8 import OpenVinoInt8, OpenVinoInt8Mixed
from bladesmith.passes.precision import BFloat16, Float16, LinearBFloat16, RoIHeadsBFloat16
from bladesmith.passes.registry import Context, Pass, PassSkipped, names, register
from bladesmith.passes.torchscript import TorchScriptFreeze
from bladesmith.passes.winograd import Winograd

# The order the built-in passes run in (module rewrites first, then what builds a runner).
ORDER = (
    FixedShape,
    HeadPacking,
    Float16,
    BFloat16,
    Winograd,
    NormFolding,
    ChannelsLast,
    ConvFusion,
    ChannelPadding,
    RoIHeadsBFloat16,
    LinearBFloat16,
    Inductor,
    Float8,
    Float8Static,
    Float8Mixed,
    TorchScriptFreeze,
    CudnnBenchmark,
    CudaGraph,
    OnnxRuntime,
    OpenVino,
    OpenVinoF32,
    OpenVinoInt8,
    OpenVinoInt8Mixed,
)
for _pass in ORDER:
    register(_pass)

__all__ = ["ORDER", "Candidate", "Context", "Pass", "PassSkipped", "names", "register"]
