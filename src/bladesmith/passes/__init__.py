"""bladesmith's passes, one module each; importing this package registers them.

The import order below is the order passes run in: adapt the model first (fixed
shapes, the head over all levels at once), then change its arithmetic (precision,
convolution algorithm, memory format), then build what runs it (Inductor and a CUDA
graph on the GPU; TorchScript or ONNX Runtime on the CPU). TorchScript is frozen
before the CUDA graph captures it.
"""

# isort: off
from bladesmith.passes import retinanet_adapter  # noqa: F401
from bladesmith.passes import head_packing  # noqa: F401
from bladesmith.passes import precision  # noqa: F401
from bladesmith.passes import winograd  # noqa: F401
from bladesmith.passes import norm_folding  # noqa: F401
from bladesmith.passes import channels_last  # noqa: F401
from bladesmith.passes import conv_fusion  # noqa: F401
from bladesmith.passes import channel_padding  # noqa: F401
from bladesmith.passes import inductor  # noqa: F401
from bladesmith.passes import torchscript  # noqa: F401
from bladesmith.passes import cudnn_benchmark  # noqa: F401
from bladesmith.passes import cuda_graph  # noqa: F401
from bladesmith.passes import onnxruntime  # noqa: F401

# isort: on
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped, names, register

__all__ = ["Candidate", "Context", "Pass", "PassSkipped", "names", "register"]
