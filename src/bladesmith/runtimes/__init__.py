"""What runs an optimized model: the runners that passes build and artifacts load.

``torchscript`` (frozen TorchScript), ``onnxruntime`` (an ONNX Runtime session called
like a module) and ``cuda_graph`` (a call replayed from CUDA graphs). ``bladesmith.load``
needs only these; nothing here imports ``bladesmith.passes``.
"""
