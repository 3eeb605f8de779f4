"""Output comparison: tensors by tolerance and error statistics, detections by matching,
any structure of them by path.

``tolerance`` holds the policy (defaults by dtype, per-output overrides, the ceilings
no tolerance passes, where each comes from), ``boxes`` what the IoU rule lets a box
move, ``tensors`` and ``detections`` the comparators (``fields``: a detection's masks,
keypoints and other fields), ``degenerate`` what makes a comparison compare
nothing (``ties``: what rounding alone may change in a
detector's output), ``outputs`` the walk over a model's output structure.
"""

from bladesmith.verify._format import dtype_name
from bladesmith.verify.degenerate import degenerate_reasons
from bladesmith.verify.detections import (
    DetectionComparison,
    compare_detections,
    contains_detections,
    is_detection_list,
)
from bladesmith.verify.outputs import Comparison, compare_outputs, tensor_paths
from bladesmith.verify.tensors import TensorComparison, compare_tensors
from bladesmith.verify.tolerance import (
    NoiseTolerances,
    Tolerance,
    default_tolerance,
    detection_score_tolerance,
    noise_tolerances,
    rounding_unit,
)

__all__ = [
    "Comparison",
    "DetectionComparison",
    "NoiseTolerances",
    "TensorComparison",
    "Tolerance",
    "compare_detections",
    "compare_outputs",
    "compare_tensors",
    "contains_detections",
    "default_tolerance",
    "degenerate_reasons",
    "detection_score_tolerance",
    "dtype_name",
    "is_detection_list",
    "noise_tolerances",
    "rounding_unit",
    "tensor_paths",
]
