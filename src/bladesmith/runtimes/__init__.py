"""What runs an optimized model: the runners that passes build and artifacts load, and
the saved formats (``formats.FORMATS``), one module each.

``aoti`` (AOTInductor ``.pt2`` packages), ``torchscript`` (frozen TorchScript, ``.pt``),
``onnxruntime`` (an ONNX Runtime session called like a module, ``.onnx``), ``cuda_graph``
(a call replayed from CUDA graphs, which no file holds); ``built_for`` (what a saved
runner takes, checked at each call), ``pt2_archive`` (a ``.pt2`` read without running
it). ``bladesmith.load`` needs only these; nothing here imports ``bladesmith.passes``.
"""
