"""bladesmith.onnx.export: both custom-op modes, run in ONNX Runtime, against PyTorch and
torchvision; the checker, external data, atomic writes, the CLI."""

from __future__ import annotations

import math
import sys
from importlib.util import find_spec

import onnx
import pytest
import torch
import torchvision

import bladesmith.onnx
from bladesmith.errors import BladesmithError
from bladesmith.onnx import export, session
from bladesmith.onnx.symbolic import DOMAIN, OP_TYPES
from bladesmith.verify import compare_detections, compare_outputs

MODES = ("domain", "standard")
BBOX_CLIP = math.log(1000.0 / 16)
OUTPUT_NAMES = ["boxes", "scores", "labels", "num_detections"]


@pytest.fixture(scope="module", autouse=True)
def _ops():
    from bladesmith import ops

    ops.load_library()


class Postprocess(torch.nn.Module):
    """The fused operator, as a detector's last step."""

    def __init__(self, anchors, level_sizes, topk=100, max_detections=50):
        super().__init__()
        self.register_buffer("anchors", anchors)
        self.level_sizes, self.topk, self.max_detections = level_sizes, topk, max_detections

    def forward(self, cls_logits, bbox_deltas, image_sizes):
        return torch.ops.bladesmith.retinanet_postprocess(
            cls_logits,
            bbox_deltas,
            self.anchors.to(cls_logits.dtype),
            self.level_sizes,
            image_sizes,
            0.05,
            self.topk,
            0.5,
            self.max_detections,
            [1.0, 1.0, 2.0, 2.0],
            BBOX_CLIP,
        )


class DecodeThenNms(Postprocess):
    """The two operators one after the other, with arithmetic on their outputs between."""

    def forward(self, cls_logits, bbox_deltas, image_sizes):
        boxes, scores, labels = torch.ops.bladesmith.retinanet_decode(
            cls_logits,
            bbox_deltas,
            self.anchors,
            self.level_sizes,
            image_sizes,
            0.05,
            self.topk,
            [1.0, 1.0, 2.0, 2.0],
            BBOX_CLIP,
        )
        return torch.ops.bladesmith.batched_nms(boxes * 1.0, scores, labels, 0.5, 50)


class Nms(torch.nn.Module):
    def __init__(self, max_detections):
        super().__init__()
        self.max_detections = max_detections

    def forward(self, boxes, scores, labels):
        return torch.ops.bladesmith.batched_nms(boxes, scores, labels, 0.5, self.max_detections)


def head_outputs(batch=2, num_classes=5, levels=(300, 80, 20), seed=0, per_image=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(levels)
    corner = torch.rand(n, 2, generator=g) * 100
    anchors = torch.cat([corner, corner + torch.rand(n, 2, generator=g) * 30 + 4], 1)
    if per_image:
        anchors = anchors.expand(batch, n, 4) + torch.rand(batch, n, 4, generator=g)
    cls_logits = torch.randn(batch, n, num_classes, generator=g) - 1.0
    bbox_deltas = torch.randn(batch, n, 4, generator=g) * 0.3
    image_sizes = torch.tensor([[100, 120], [90, 110]])[:batch]
    return anchors, list(levels), (cls_logits, bbox_deltas, image_sizes)


def ort_session(path, mode):
    if mode == "domain" and find_spec("onnxruntime_extensions") is None:
        pytest.skip("domain mode runs through onnxruntime-extensions, not installed here")
    return session(path, device="cpu")


def run_exported(module, args, path, mode):
    export(module, args, path, custom_ops=mode, output_names=OUTPUT_NAMES)
    return ort_session(path, mode)(*args)


def as_detections(outputs):
    boxes, scores, labels, counts = outputs
    return [
        {"boxes": boxes[i, :n], "scores": scores[i, :n], "labels": labels[i, :n]}
        for i, n in enumerate(counts.tolist())
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("module_type", [Postprocess, DecodeThenNms])
def test_operators_run_in_onnxruntime_with_pytorchs_outputs(tmp_path, mode, module_type):
    anchors, levels, args = head_outputs()
    module = module_type(anchors, levels).eval()
    expected = module(*args)
    actual = run_exported(module, args, tmp_path / "model.onnx", mode)
    comparison = compare_outputs(expected, actual)
    assert comparison.passed, comparison.summary()
    assert (actual[3] > 0).all()  # something to compare


def test_domain_mode_gives_one_custom_node_per_operator(tmp_path):
    anchors, levels, args = head_outputs()
    for module, ops in [
        (Postprocess(anchors, levels), ["retinanet_postprocess"]),
        (DecodeThenNms(anchors, levels), ["retinanet_decode", "batched_nms"]),
    ]:
        path = export(module, args, tmp_path / "domain.onnx", custom_ops="domain")
        model = onnx.load(path)
        custom = [node.op_type for node in model.graph.node if node.domain == DOMAIN]
        assert custom == [OP_TYPES[op] for op in ops]
        assert {(o.domain, o.version) for o in model.opset_import} == {("", 17), (DOMAIN, 1)}


def test_standard_mode_is_plain_onnx_with_static_shapes_and_no_control_flow(tmp_path):
    anchors, levels, args = head_outputs()
    path = export(
        Postprocess(anchors, levels),
        args,
        tmp_path / "standard.onnx",
        custom_ops="standard",
        output_names=OUTPUT_NAMES,
    )
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    op_types = {node.op_type for node in model.graph.node}
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}
    assert {"NonMaxSuppression", "TopK", "Sigmoid", "GatherND"} <= op_types
    assert not op_types & {"If", "Loop", "Scan"}
    shapes = {
        output.name: [d.dim_value for d in output.type.tensor_type.shape.dim]
        for output in model.graph.output
    }
    assert shapes == {
        "boxes": [2, 50, 4],
        "scores": [2, 50],
        "labels": [2, 50],
        "num_detections": [2],
    }


@pytest.mark.parametrize("mode", MODES)
def test_edge_cases_keep_fixed_shapes_and_padding(tmp_path, mode):
    anchors, levels, (cls_logits, bbox_deltas, image_sizes) = head_outputs()
    cases = {
        "nothing passes the threshold": (Postprocess(anchors, levels), cls_logits - 30.0),
        "fewer candidates than slots": (Postprocess(anchors, levels, 10, 100), cls_logits),
    }
    for name, (module, logits) in cases.items():
        args = (logits, bbox_deltas, image_sizes)
        expected = module(*args)
        actual = run_exported(module, args, tmp_path / "edge.onnx", mode)
        comparison = compare_outputs(expected, actual)
        assert comparison.passed, f"{name}: {comparison.summary()}"
        boxes, scores, labels, counts = actual
        for image, count in enumerate(counts.tolist()):
            assert (labels[image, count:] == -1).all(), name
            assert (scores[image, count:] == 0).all() and (boxes[image, count:] == 0).all()
        assert (counts <= 30).all()  # 3 levels of at most 10 candidates, or none


def test_per_image_anchors_and_float16_in_standard_mode(tmp_path):
    anchors, levels, args = head_outputs(per_image=True)
    module = DecodeThenNms(anchors, levels).eval()
    comparison = compare_outputs(
        module(*args), run_exported(module, args, tmp_path / "a.onnx", "standard")
    )
    assert comparison.passed, comparison.summary()

    anchors, levels, (cls_logits, bbox_deltas, image_sizes) = head_outputs()
    half = (cls_logits.half(), bbox_deltas.half(), image_sizes)
    module = Postprocess(anchors, levels).eval()
    actual = run_exported(module, half, tmp_path / "h.onnx", "standard")
    assert actual[0].dtype == torch.float16
    comparison = compare_outputs(module(*half), actual)
    assert comparison.passed, comparison.summary()


def test_domain_mode_refuses_float16_and_says_what_to_do(tmp_path):
    anchors, levels, (cls_logits, bbox_deltas, image_sizes) = head_outputs()
    half = (cls_logits.half(), bbox_deltas.half(), image_sizes)
    with pytest.raises(BladesmithError, match="custom_ops='standard'"):
        export(Postprocess(anchors, levels), half, tmp_path / "h.onnx", custom_ops="domain")
    assert not list(tmp_path.iterdir())  # nothing half-written


def overlapping_detections(seed, batch=2, k=400, num_classes=4):
    """Clustered boxes of several classes (many overlaps across and within classes),
    distinct scores, and padding slots (label -1), as the decode operator leaves them."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(batch, k // 8, 1, 2, generator=g) * 200 - 20  # some go negative
    centre = (centres + torch.randn(batch, k // 8, 8, 2, generator=g) * 3).reshape(batch, k, 2)
    size = torch.rand(batch, k, 2, generator=g) * 20 + 10
    boxes = torch.cat([centre - size / 2, centre + size / 2], 2)
    scores = torch.rand(batch, k, generator=g)
    labels = torch.randint(0, num_classes, (batch, k), generator=g)
    padding = torch.rand(batch, k, generator=g) < 0.2
    return (
        boxes.masked_fill(padding[..., None], 0.0),
        scores.masked_fill(padding, 0.0),
        labels.masked_fill(padding, -1),
    )


def torchvision_reference(boxes, scores, labels, max_detections):
    detections = []
    for image_boxes, image_scores, image_labels in zip(boxes, scores, labels, strict=True):
        valid = image_labels >= 0
        b, s, c = image_boxes[valid], image_scores[valid], image_labels[valid]
        keep = torchvision.ops.batched_nms(b, s, c, 0.5)[:max_detections]
        detections.append({"boxes": b[keep], "scores": s[keep], "labels": c[keep]})
    return detections


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_nms_equals_torchvisions_class_aware_nms(tmp_path, mode, seed):
    args = overlapping_detections(seed)
    actual = run_exported(Nms(60), args, tmp_path / "nms.onnx", mode)
    expected = torchvision_reference(*args, max_detections=60)
    comparison = compare_detections(
        expected, as_detections(actual), iou_threshold=0.999, min_f1=1.0
    )
    assert comparison.passed, comparison.summary()
    assert actual[3].tolist() == [len(d["boxes"]) for d in expected]
    for image, detections in enumerate(expected):  # same order: by descending score
        n = len(detections["scores"])
        torch.testing.assert_close(actual[1][image, :n], detections["scores"])


@pytest.fixture(scope="module")
def tiny_retinanet():
    from bladesmith.families.retinanet import RetinaNetPipeline
    from bladesmith.images import sample_images
    from bladesmith.models import build_retinanet

    size = (64, 96)
    model = build_retinanet(size, num_classes=3, backbone="resnet18")
    images = sample_images(2, size)
    with torch.no_grad():
        reference = model(list(images))
    return RetinaNetPipeline(model, size).eval(), images, reference


@pytest.mark.parametrize("mode", MODES)
def test_retinanet_in_onnxruntime_has_torchvisions_detections(tmp_path, tiny_retinanet, mode):
    pipeline, images, reference = tiny_retinanet
    path = export(
        pipeline,
        images,
        tmp_path / "retinanet.onnx",
        custom_ops=mode,
        input_names=["images"],
        output_names=OUTPUT_NAMES,
    )
    retinanet = ort_session(path, mode)
    assert retinanet.providers == ["CPUExecutionProvider"]
    assert retinanet.input_names == ["images"]
    comparison = compare_detections(reference, as_detections(retinanet(images)))
    assert comparison.passed, comparison.summary()
    assert comparison.reference_count > 100


def test_external_data_is_written_beside_the_model_and_loads(tmp_path):
    anchors, levels, args = head_outputs()
    module = Postprocess(anchors, levels).eval()
    path = export(module, args, tmp_path / "big.onnx", custom_ops="standard", external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    model = onnx.load(path, load_external_data=False)
    locations = {
        entry.value
        for tensor in model.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    assert locations == {"big.onnx.data"}
    onnx.checker.check_model(str(path), full_check=True)
    comparison = compare_outputs(module(*args), session(path, device="cpu")(*args))
    assert comparison.passed, comparison.summary()


class Untranslatable(torch.nn.Module):
    def forward(self, x):
        return torch.special.i0(x)  # no ONNX translation at opset 17


def test_a_failed_export_leaves_no_file_and_the_old_one_intact(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"previous")
    with pytest.raises(BladesmithError, match="aten::i0.*needs an ONNX translation"):
        export(Untranslatable(), torch.randn(3), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    assert path.read_bytes() == b"previous"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"custom_ops": "plugin"}, "custom_ops must be one of 'domain', 'standard'"),
        ({"opset": 11}, "opset >= 13"),
    ],
)
def test_bad_arguments_say_what_is_accepted(tmp_path, kwargs, message):
    with pytest.raises(BladesmithError, match=message):
        export(torch.nn.Identity(), torch.zeros(1), tmp_path / "m.onnx", **kwargs)
    with pytest.raises(BladesmithError, match="must end in .onnx"):
        export(torch.nn.Identity(), torch.zeros(1), tmp_path / "m.pt")


def test_export_of_a_plain_module_needs_no_custom_domain(tmp_path, capfd):
    path = export(torch.nn.Linear(3, 2).eval(), torch.zeros(1, 3), tmp_path / "linear.onnx")
    assert [o.domain for o in onnx.load(path).opset_import] == [""]
    # No domain is declared that the graph does not use: torch warned on every export.
    assert "Custom opset domain" not in capfd.readouterr().err


def test_a_module_whose_forward_has_bool_defaults_exports_with_its_outputs(tmp_path):
    """torch's exporter passed is_causal=False to the trace as a tensor, and
    scaled_dot_product_attention refused it ("must be bool, not Tensor")."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    path = export(layer, (x,), tmp_path / "encoder.onnx")
    assert not layer.training  # left in the mode it was given in
    (got,) = session(path, device="cpu")(x)
    with torch.no_grad():
        torch.testing.assert_close(got, layer(x), rtol=1e-4, atol=1e-5)


class OptionalBias(torch.nn.Module):
    def forward(self, x, bias: torch.Tensor | None = None):
        return x * 2 if bias is None else x * 2 + bias


class WithoutBias(torch.nn.Module):
    """What the refusal advises: a module whose forward calls the model without it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def test_a_scripted_forwards_argument_left_at_its_default_is_named(tmp_path):
    """torch's exporter failed inside ("INTERNAL ASSERT FAILED ... 2 vs 1")."""
    model, x = torch.jit.script(OptionalBias()), torch.rand(2, 3)
    with pytest.raises(BladesmithError) as raised:
        export(model, (x,), tmp_path / "optional.onnx")
    message = str(raised.value)
    assert message.startswith(
        "ONNX export: the scripted forward's argument bias: Optional[Tensor] = None is left "
        "at its default"
    )
    assert "INTERNAL ASSERT" not in message and "\n" not in message
    path = export(torch.jit.script(WithoutBias(model)), (x,), tmp_path / "without.onnx")
    (got,) = session(path, device="cpu")(x)
    torch.testing.assert_close(got, 2 * x)


class Flags(torch.nn.Module):
    """Non-tensor arguments, which the export holds as constants in the graph."""

    def forward(self, x, negate: bool, repeat: int):
        for _ in range(repeat):
            x = x * 2
        return -x if negate else x


def test_a_session_refuses_other_values_of_arguments_the_export_held_as_constants(tmp_path):
    x = torch.rand(2, 3)
    path = export(Flags(), (x, True, 1), tmp_path / "flags.onnx")
    ort_session = session(path, device="cpu")
    assert [e["name"] for e in ort_session.baked_arguments] == ["negate", "repeat"]
    (expected,) = ort_session(x)  # the tensors alone, as ever
    torch.testing.assert_close(expected, -2 * x)
    (same,) = ort_session(x, True, 1)  # or the module's own arguments
    torch.testing.assert_close(same, expected)
    with pytest.raises(
        BladesmithError, match="negate=False: .*exported with negate=True"
    ) as raised:
        ort_session(x, False, 1)
    assert "\n" not in str(raised.value)
    with pytest.raises(BladesmithError, match="repeat=3: .*exported with repeat=1"):
        ort_session(x, True, 3)
    with pytest.raises(BladesmithError, match="negate=1: "):  # 1 is not True here
        ort_session(x, 1, 1)


def test_a_bfloat16_model_is_refused_as_the_models_choice_not_a_bug(tmp_path):
    model = torch.nn.Conv2d(3, 4, 3).to(torch.bfloat16).eval()
    with pytest.raises(BladesmithError, match="computes in bfloat16") as raised:
        export(model, torch.zeros(1, 3, 8, 8, dtype=torch.bfloat16), tmp_path / "bf16.onnx")
    message = str(raised.value)
    assert "export the model in float32" in message and "bladesmith bug" not in message
    assert "\n" not in message


def test_public_names_are_the_functions():
    import bladesmith.onnx.exporter as export_module  # noqa: F401  binds the submodule

    assert bladesmith.onnx.export is export
    assert callable(bladesmith.onnx.check) and callable(bladesmith.onnx.fix)


def test_session_explains_a_missing_onnxruntime_extensions(tmp_path, monkeypatch):
    anchors, levels, args = head_outputs()
    path = export(Postprocess(anchors, levels), args, tmp_path / "d.onnx", custom_ops="domain")
    monkeypatch.setitem(sys.modules, "onnxruntime_extensions", None)
    monkeypatch.delitem(sys.modules, "bladesmith.onnx.contrib_ops", raising=False)
    monkeypatch.delattr(bladesmith.onnx, "contrib_ops", raising=False)
    with pytest.raises(BladesmithError, match="pip install onnxruntime-extensions"):
        session(path, device="cpu")


class Detector(torch.nn.Module):
    """images [B, 3, 32, 192] -> a head on 8 x 48 positions -> the operator."""

    def __init__(self):
        super().__init__()
        anchors, levels, _ = head_outputs(batch=1, levels=(256, 96, 32))
        self.post = Postprocess(anchors, levels)
        self.head = torch.nn.Conv2d(3, 9, 4, stride=4)
        self.norm = torch.nn.BatchNorm2d(9)

    def forward(self, images):
        features = self.norm(self.head(images)).flatten(2).transpose(1, 2)  # [B, 384, 9]
        sizes = torch.tensor([[32, 192]]).expand(images.shape[0], 2)
        return self.post(features[..., :5], features[..., 5:], sizes)


@pytest.mark.parametrize("mode", MODES)
def test_cli_exports_a_torchscript_file(tmp_path, capsys, mode):
    from bladesmith.cli import main

    module = Detector().eval()
    torch.jit.trace(module, torch.rand(1, 3, 32, 192)).save(str(tmp_path / "model.pt"))
    out = tmp_path / "model.onnx"
    argv = ["export", "onnx", str(tmp_path / "model.pt"), str(out), "--custom-ops", mode]
    assert main([*argv, "--input-size", "32x192", "--batch", "1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    images = torch.rand(1, 3, 32, 192)
    comparison = compare_outputs(module(images), ort_session(out, mode)(images))
    assert comparison.passed, comparison.summary()


@pytest.mark.parametrize("mode", MODES)
def test_cli_exports_a_torch_export_file_at_the_shape_it_was_exported_for(tmp_path, capsys, mode):
    """A .pt2 file loads as ExportedProgram.module(), whose train() raises: it exports as
    it was captured (eval), in either custom-op mode, at its static input shape."""
    from bladesmith.cli import main

    module = Detector().eval()
    module.norm.running_mean.uniform_()  # eval and train differ
    program = torch.export.export(module, (torch.rand(2, 3, 32, 192),))
    torch.export.save(program, tmp_path / "model.pt2")
    out = tmp_path / "model.onnx"
    argv = ["export", "onnx", str(tmp_path / "model.pt2"), str(out), "--custom-ops", mode]
    assert main(argv) == 0
    assert "input images [2, 3, 32, 192]" in capsys.readouterr().out
    images = torch.rand(2, 3, 32, 192)
    comparison = compare_outputs(module(images), ort_session(out, mode)(images))
    assert comparison.passed, comparison.summary()

    out.unlink()
    assert main([*argv, "--batch", "1"]) == 2  # its guards would refuse batch 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch" in err and "[2, 3, 32, 192]" in err
    assert not out.exists()


def test_cli_refuses_an_onnx_model_and_an_opset_it_cannot_export(tmp_path, capsys):
    from bladesmith.cli import main

    source = tmp_path / "model.onnx"
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])), source)
    assert main(["export", "onnx", str(source), str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert "an ONNX model" in err and "check and fix" in err and "optimize" not in err
    for opset in ("99", "12"):
        with pytest.raises(SystemExit) as stopped:
            main(["export", "onnx", "x.pt", str(tmp_path / "o.onnx"), "--opset", opset])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--opset" in err and opset in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_cli_rejects_an_unknown_model(tmp_path, capsys):
    from bladesmith.cli import main

    assert main(["export", "onnx", str(tmp_path / "none.pt"), str(tmp_path / "m.onnx")]) == 2
    assert "no such file; expected a built-in model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "onnx", "x", "y.onnx", "--input-size", "480"])
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_cli_exports_the_builtin_retinanet(tmp_path, capsys):
    from bladesmith.cli import main

    out = tmp_path / "retinanet.onnx"
    argv = ["export", "onnx", "torchvision:retinanet_resnet50_fpn", str(out)]
    options = ["--custom-ops", "standard", "--input-size", "64x96", "--num-classes", "3"]
    assert main([*argv, *options]) == 0
    assert "custom ops: standard, input images [1, 3, 64, 96]" in capsys.readouterr().out
    retinanet = session(out, device="cpu")
    assert retinanet.input_names == ["images"]
    assert retinanet.output_names == OUTPUT_NAMES
    boxes, scores, labels, counts = retinanet(torch.rand(1, 3, 64, 96))
    assert boxes.shape == (1, 300, 4) and labels.shape == (1, 300) and counts.shape == (1,)


class ImagesInDicts(torch.nn.Module):
    """PAI-Blade's detection tutorial's form: a list of {"image": tensor} dicts."""

    def forward(self, batched_inputs: list[dict[str, torch.Tensor]]):
        return torch.stack([d["image"] / 255.0 for d in batched_inputs]) * 2


def test_a_scripted_forward_taking_dicts_is_named(tmp_path):
    """The export wrote a graph input of no type, which ONNX's shape inference refused as
    "Invalid tensor data type 0."."""
    with pytest.warns(FutureWarning):
        model = torch.jit.script(ImagesInDicts())
    with pytest.raises(BladesmithError) as raised:
        export(model, ([{"image": torch.rand(3, 8, 8)}],), tmp_path / "dicts.onnx")
    message = str(raised.value)
    assert message.startswith(
        "ONNX export: the scripted forward's argument batched_inputs: "
        "List[Dict[str, Tensor]] is not a tensor"
    ), message
    assert "data type 0" not in message and "\n" not in message
    assert not (tmp_path / "dicts.onnx").exists()


class RaisesWithoutMessage(torch.nn.Module):
    def forward(self, x):
        try:
            int("three")
        except ValueError as error:
            raise RuntimeError() from error
        return x


def test_an_export_error_without_a_message_names_the_error_it_was_raised_from(tmp_path):
    """Before: "torch.onnx.export failed (RuntimeError: )"."""
    with pytest.raises(BladesmithError) as raised:
        export(RaisesWithoutMessage(), (torch.rand(2),), tmp_path / "empty.onnx")
    message = str(raised.value)
    assert message.startswith(
        "torch.onnx.export failed (RuntimeError with no message, raised from ValueError: "
        "invalid literal for int() with base 10: 'three')"
    ), message


class _Float8Cast(torch.nn.Module):
    """A cast to float8: the TorchScript exporter has no ONNX type for it and fails."""

    def forward(self, x):
        return x.to(torch.float8_e4m3fn).float() * 2


def test_a_failed_export_is_one_line_not_the_exporters_graph_dump(tmp_path, capfd):
    """torch's exporter prints the whole TorchScript graph on stdout, from C++, when it
    fails (its ONNX log is left on): thousands of lines for a real model."""
    with pytest.raises(BladesmithError) as error:
        export(_Float8Cast(), (torch.ones(2, 4),), tmp_path / "m.onnx")
    out, err = capfd.readouterr()
    assert "graph" not in out and "graph(" not in err, (out + err)[:300]
    assert "\n" not in str(error.value)
    print("after")  # the process's stdout works again
    assert capfd.readouterr().out == "after\n"


class _Talking(torch.nn.Module):
    def forward(self, x):
        print("traced")
        return x * 2


def test_what_a_model_prints_while_it_exports_is_still_printed(tmp_path, capfd):
    export(_Talking(), (torch.ones(2, 4),), tmp_path / "m.onnx")
    assert capfd.readouterr().out == "traced\n"
