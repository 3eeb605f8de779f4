"""verify.boxes: what the IoU rule lets a box's coordinates move, and which tensors are
boxes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bladesmith.verify.boxes import box_rule, largest_image_size, looks_like_boxes, row_ious


def random_boxes(n: int, side: float, generator: torch.Generator) -> torch.Tensor:
    corners = torch.rand(n, 2, 2, generator=generator) * side
    low, high = corners.min(1).values, corners.max(1).values
    return torch.cat([low, high], 1)


@pytest.mark.parametrize("iou_threshold", [0.5, 0.75, 0.9])
def test_no_box_keeps_the_iou_rule_with_a_coordinate_moved_past_the_ceiling(iou_threshold):
    """The bound S (1 - t) holds for every box of an S x S image and every coordinate,
    moved either way within the image, and it is tight: a box of side S t moved by just
    under it keeps IoU t."""
    side = 320.0
    rule = box_rule(torch.tensor([[0.0, 0.0, 10.0, 10.0]]), iou_threshold, (320, 320))
    ceiling = side * (1 - iou_threshold)
    assert rule.ceiling == (pytest.approx(ceiling), pytest.approx(ceiling))
    generator = torch.Generator().manual_seed(0)
    boxes = random_boxes(20000, side, generator)
    coordinate = torch.randint(0, 4, (len(boxes),), generator=generator)
    sign = torch.where(torch.rand(len(boxes), generator=generator) < 0.5, -1.0, 1.0)
    moved = boxes.clone()
    rows = torch.arange(len(boxes))
    moved[rows, coordinate] += sign * ceiling * (1 + 1e-6)
    inside = ((moved >= 0) & (moved <= side)).all(1)
    inside &= (moved[:, 2] >= moved[:, 0]) & (moved[:, 3] >= moved[:, 1])
    assert inside.sum() > 1000
    assert float(row_ious(boxes[inside], moved[inside]).max()) < iou_threshold
    tight = torch.tensor([[0.0, 0.0, side * iou_threshold, side]])
    grown = tight.clone()
    grown[0, 2] += ceiling * (1 - 1e-6)
    assert float(row_ious(tight, grown)[0]) >= iou_threshold


def test_without_an_image_the_reference_boxes_span_bounds_the_move():
    boxes = torch.tensor([[-20.0, 10.0, 100.0, 50.0], [30.0, 0.0, 180.0, 60.0]])
    rule = box_rule(boxes, 0.5, None)
    assert rule.ceiling == (pytest.approx(100.0), pytest.approx(30.0))
    assert "extent (200x60)" in rule.source
    assert "100 px (x), 30 px (y)" in rule.source


def test_boxes_are_told_apart_from_other_four_wide_tensors():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 20.0], [5.0, 5.0, 6.0, 9.0]])
    scores, labels = torch.rand(2), torch.tensor([1, 2])
    assert looks_like_boxes(boxes, "boxes")
    assert looks_like_boxes(boxes, 0, [scores, labels])  # a detector's tuple
    assert looks_like_boxes(boxes.numpy(), 0, [labels.numpy()])  # ONNX Runtime's arrays
    assert not looks_like_boxes(boxes, 0, [])  # a lone [n, 4] may be anything
    assert not looks_like_boxes(boxes, "logits", [torch.rand(3)])
    logits = torch.tensor([[2.0, -1.2, 0.3, 0.1]])  # four classes: x2 < x1
    assert not looks_like_boxes(logits, "pred_boxes")
    assert not looks_like_boxes(torch.tensor([[0, 0, 4, 4]]), "boxes")  # integer
    assert not looks_like_boxes(np.array(["a", "b", "c", "d"]), "boxes")


def test_the_image_size_is_found_in_any_input_structure():
    image = torch.rand(3, 320, 240)
    assert largest_image_size([([{"image": image}],)]) == (240, 320)
    batch = torch.rand(2, 3, 64, 96)
    assert largest_image_size([(batch,), (torch.rand(1, 3, 32, 32),)]) == (96, 64)
    assert largest_image_size([(torch.randint(0, 9, (1, 16)),)]) is None  # token ids
    assert largest_image_size([(torch.rand(1, 1, 16000),)]) is None  # a sound
    assert largest_image_size(None) is None
