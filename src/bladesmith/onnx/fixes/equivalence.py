"""Whether the fixed model computes what the original does: both run in ONNX Runtime's
CPU provider on the same synthesised inputs, each output compared with bladesmith's
tensor comparison (verify.compare_tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from bladesmith.onnx.fixes.base import InvalidInputError, error_line
from bladesmith.onnx.fixes.static_input_shapes import cannot_run_at


@dataclass
class Verification:
    """Outputs of the original and the fixed model on the same inputs (ORT CPU)."""

    # "passed" | "failed" | "skipped" (not asked for) | "unverified" (could not be run:
    # dynamic inputs without input_shapes, or ONNX Runtime cannot run the original)
    status: str
    reason: str = ""
    outputs: dict[str, str] = field(default_factory=dict)  # output -> comparison summary


def compare_in_onnxruntime(
    original: onnx.ModelProto, fixed: onnx.ModelProto, shapes: dict[str, list[int]]
) -> Verification:
    """`fixed` against `original` on inputs synthesised at `shapes`: "failed" names the
    first output that differs; InvalidInputError when the original loads but cannot run
    at the shapes the caller gave."""
    from bladesmith.verify import compare_tensors

    try:
        feeds = synthesise_inputs(original, shapes)
    except (ValueError, MemoryError) as error:  # MemoryError: inputs too large to make
        return Verification("unverified", error_line(error))
    try:
        session = _cpu_session(original)
    except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
        return Verification("unverified", f"ONNX Runtime CPU cannot run it: {error_line(error)}")
    try:
        references = session.run(None, feeds)
    except Exception as error:
        if shapes:  # it loads, but not at the shape given
            raise InvalidInputError(
                cannot_run_at(shapes, f"ONNX Runtime CPU: {error_line(error)}")
            ) from None
        return Verification("unverified", f"ONNX Runtime CPU cannot run it: {error_line(error)}")
    try:
        candidates = _cpu_session(fixed).run(None, feeds)
    except Exception as error:
        return Verification(
            "failed",
            "ONNX Runtime CPU runs the original on synthesised inputs but not the fixed "
            f"model on the same inputs, so no outputs were compared: {error_line(error)}",
        )
    names = [output.name for output in original.graph.output]
    verification = Verification("passed")
    for name, reference, candidate in zip(names, references, candidates, strict=True):
        comparison = compare_tensors(reference, candidate)
        verification.outputs[name] = comparison.summary()
        if not comparison.passed:
            verification.status = "failed"
            verification.reason = f"output {name}: {comparison.summary()}"
    return verification


def _cpu_session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures come back as exceptions, said in one line
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def synthesise_inputs(
    model: onnx.ModelProto, shapes: Mapping[str, list[int]] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs for every graph input; ValueError names an input whose shape is not
    fixed (neither static in the model nor given in `shapes`) or that is not a numeric
    tensor (a sequence, an optional, strings)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for graph_input in model.graph.input:
        if graph_input.name in initializers:
            continue
        tensor_type = graph_input.type.tensor_type
        if graph_input.type.WhichOneof("value") != "tensor_type" or tensor_type.elem_type in (
            0,
            onnx.TensorProto.STRING,
        ):
            raise ValueError(
                f"input {graph_input.name!r} is not a numeric tensor; random values for it "
                "cannot be made"
            )
        dims = shapes.get(graph_input.name) or [
            dim.dim_value if dim.HasField("dim_value") else None for dim in tensor_type.shape.dim
        ]
        if any(dim is None for dim in dims):
            raise ValueError(
                f"input {graph_input.name!r} has dynamic dimensions; give input_shapes "
                "to verify the fixed model"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[graph_input.name] = rng.standard_normal(dims).astype(dtype)
        elif dtype == np.bool_:
            feeds[graph_input.name] = rng.random(dims) < 0.5
        else:
            feeds[graph_input.name] = rng.integers(0, 8, size=dims).astype(dtype)
    return feeds
