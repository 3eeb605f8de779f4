"""`bladesmith export onnx MODEL OUT`: a built-in model or a model file to ONNX;
`bladesmith export triton ARTIFACT REPO_DIR`: a Triton model repository for an artifact.

    bladesmith export onnx torchvision:retinanet_resnet50_fpn retinanet.onnx \\
        --custom-ops standard --input-size 480x640 --batch 1
    bladesmith export triton rn.pt triton_models --name retinanet

Only argparse is imported here; torch and the exporter are imported when it runs.
"""

from __future__ import annotations

import argparse

from bladesmith.cli.args import (
    add_library_options,
    add_trust_option,
    at_least,
    check_images_fit,
    input_size,
    output_file,
    readable_file,
)
from bladesmith.cli.models import DEFAULT_MODEL, MODEL_HELP
from bladesmith.cli.serve import add_deployment_options


def add_parser(subparsers) -> None:
    export = subparsers.add_parser(
        "export", help="export a model to a deployable format", description="Export a model."
    )
    formats = export.add_subparsers(dest="format", metavar="FORMAT", required=True)
    parser = formats.add_parser(
        "onnx",
        help="export to ONNX, the bladesmith operators as custom nodes or standard ONNX",
        description=(
            f"Export MODEL ({DEFAULT_MODEL}, or a TorchScript/torch.export file taking one "
            "image batch [N, 3, H, W] in [0, 1]) to the ONNX file OUT, checked with ONNX's "
            "full checker. Built-in models have random weights unless --weights "
            "names a local state-dict file."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument(
        "output", type=output_file(".onnx"), metavar="OUT", help="the .onnx file to write"
    )
    parser.add_argument(
        "--opset",
        type=_opset,
        default=17,
        help="ONNX opset, 13 to the newest the installed torch and onnx export (default 17)",
    )
    parser.add_argument(
        "--custom-ops",
        choices=("domain", "standard"),
        default="domain",
        help=(
            "domain: one ai.onnx.contrib node per operator, run by bladesmith.onnx.session; "
            "standard: standard ONNX only, for any ONNX Runtime provider and TensorRT (your "
            "own operators need an onnxscript lowering: bladesmith.onnx.register_op) "
            "(default domain)"
        ),
    )
    parser.add_argument(
        "--input-size",
        type=input_size,
        metavar="HxW",
        help="image height and width (default 480x640; a .pt2 file: the size it was "
        "exported for, where static)",
    )
    parser.add_argument(
        "--batch",
        type=at_least(1),
        help="batch size (default 1; a .pt2 file: the batch it was exported for, where static)",
    )
    parser.add_argument(
        "--weights", type=readable_file, help="built-in model only: a local state-dict file"
    )
    parser.add_argument(
        "--num-classes", type=at_least(1), default=91, help="built-in model only (default 91)"
    )
    parser.add_argument(
        "--external-data",
        action="store_true",
        help="write the weights to OUT.data (automatic past 2 GiB)",
    )
    add_library_options(parser)
    add_trust_option(parser)
    parser.set_defaults(func=run)
    _add_triton_parser(formats)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bladesmith.images import sample_images
    from bladesmith.onnx.exporter import export

    if args.input_size is not None and args.batch is not None:  # before loading the model
        check_images_fit((args.batch,), args.input_size)
    model, output_names = _load_model(args)
    check_images_fit((args.batch,), args.input_size)
    images = sample_images(args.batch, args.input_size)
    _check_runs(model, images, args)
    path = export(
        model,
        (images,),
        args.output,
        opset=args.opset,
        custom_ops=args.custom_ops,
        input_names=["images"],
        output_names=output_names,
        external_data=args.external_data or None,
    )
    size = sum(p.stat().st_size for p in (path, Path(f"{path}.data")) if p.exists())
    print(
        f"wrote {path} ({size / 2**20:.1f} MiB, opset {args.opset}, "
        f"custom ops: {args.custom_ops}, input images [{args.batch}, 3, "
        f"{args.input_size[0]}, {args.input_size[1]}])"
    )
    return 0


def _load_model(args):
    """The model to export, and its output names: a model that a family recognises (the
    built-in RetinaNet) as the family's fixed-shape pipeline, with its outputs' names."""
    from bladesmith.cli.models import load_model
    from bladesmith.families import family_of

    model = load_model(
        args.model, args.input_size or DEFAULT_SIZE, args.weights, args.num_classes, args.trust
    )
    _settle_input_shape(args, _exported_input_shape(model))
    family = family_of(model)
    if family is None:
        return model, None
    return family.adapt(model, args.input_size).eval(), list(family.output_names)


DEFAULT_SIZE = (480, 640)
# torch.onnx.export's TorchScript exporter, the one bladesmith uses, and the bladesmith
# operators' lowering (symbolic.MIN_OPSET) bound the opsets.
MIN_OPSET = 13


def _opset(text: str) -> int:
    """argparse type for --opset: from MIN_OPSET to the newest opset both the TorchScript
    exporter of the installed torch and the installed onnx know."""
    opset = at_least(MIN_OPSET)(text)
    newest = _newest_opset()
    if opset > newest:
        raise argparse.ArgumentTypeError(
            f"opset {opset} is newer than the installed torch and onnx export (at most "
            f"{newest}); give {MIN_OPSET} to {newest}"
        )
    return opset


def _newest_opset() -> int:
    import onnx.defs
    from torch.onnx import _constants

    exporter = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", _constants.ONNX_MAX_OPSET)
    return min(exporter, onnx.defs.onnx_opset_version())


def _exported_input_shape(model) -> list[int | None] | None:
    """The input's dimensions (None where dynamic) of a torch.export program's module
    with one tensor input, else None."""
    from bladesmith.onnx.exporter import is_program_module

    graph = getattr(model, "graph", None)
    if not is_program_module(model) or graph is None:
        return None
    values = [node.meta.get("val") for node in graph.nodes if node.op == "placeholder"]
    if len(values) != 1 or not hasattr(values[0], "shape"):
        return None
    return [dim if isinstance(dim, int) else None for dim in values[0].shape]


def _settle_input_shape(args: argparse.Namespace, shape: list[int | None] | None) -> None:
    """args.batch and args.input_size: as given, else the static dimensions a .pt2 file
    was exported for, else the defaults; BladesmithError when a given one contradicts a
    static dimension (the program's guards would refuse it)."""
    from bladesmith.errors import BladesmithError

    if shape is not None and (len(shape) != 4 or shape[1] not in (3, None)):
        raise BladesmithError(
            f"model {args.model!r} was exported for an input of shape "
            f"{_shape_text(shape)}; export onnx takes an image batch [N, 3, H, W]"
        )
    shape = shape or [None] * 4
    given = (args.batch, *(args.input_size or (None, None)))
    clash = [
        flag
        for flag, want, static in zip(
            ("--batch", "--input-size", "--input-size"),
            given,
            (shape[0], shape[2], shape[3]),
            strict=True,
        )
        if want is not None and static is not None and want != static
    ]
    if clash:
        raise BladesmithError(
            f"{clash[0]}: model {args.model!r} was exported for input {_shape_text(shape)}, "
            f"static where a number is given; leave {clash[0]} out, or export the program "
            "with dynamic dimensions (torch.export.Dim)"
        )
    args.batch = args.batch or shape[0] or 1
    if args.input_size is None:
        args.input_size = (shape[2] or DEFAULT_SIZE[0], shape[3] or DEFAULT_SIZE[1])


def _shape_text(shape) -> str:
    return "[" + ", ".join("?" if dim is None else str(dim) for dim in shape) + "]"


def _check_runs(model, images, args) -> None:
    """A model file run once on the images before the export: when it fails there, the
    exporter's message would bury the cause in its stack and name neither the file nor
    the flags to change."""
    import torch

    from bladesmith._files import first_line
    from bladesmith.cli.models import image_flags_advice
    from bladesmith.errors import BladesmithError
    from bladesmith.models.catalog import CATALOG

    if args.model in CATALOG:  # built for the size
        return
    try:
        with torch.no_grad():
            model(images)
    except Exception as error:
        raise BladesmithError(
            f"{args.model}: the model failed on images of shape {list(images.shape)}: "
            f"{first_line(error)}; {image_flags_advice(args)}"
        ) from error


def _add_triton_parser(formats) -> None:
    parser = formats.add_parser(
        "triton",
        help="a Triton model repository for a saved artifact",
        description=(
            "Write REPO_DIR/NAME/config.pbtxt and the version folder for Triton Inference "
            "Server, and REPO_DIR/README.md with the launch command. Backends: python (any "
            "artifact, dynamic batching into its batch size; the default for .pt2), "
            "pytorch_libtorch (TorchScript .pt, the libraries of the custom operators it "
            "calls beside it, to LD_PRELOAD) and onnxruntime (standard ONNX). The operator "
            "libraries saved beside the artifact (ARTIFACT.libs/) go into the repository."
        ),
    )
    parser.add_argument("artifact", metavar="ARTIFACT", help="an artifact bladesmith.save wrote")
    parser.add_argument("repository", metavar="REPO_DIR", help="model repository folder")
    parser.add_argument("--name", help="model name (default: the file's stem)")
    parser.add_argument(
        "--backend",
        choices=("python", "pytorch_libtorch", "onnxruntime"),
        help="default: the format's own Triton backend (bladesmith doctor lists them: "
        "pytorch_libtorch for .pt, onnxruntime for .onnx), python for the others",
    )
    add_deployment_options(parser)
    parser.set_defaults(func=run_triton)


def run_triton(args: argparse.Namespace) -> int:
    from bladesmith.serve.repository import Deployment, write_repository

    model_dir = write_repository(
        args.artifact,
        args.repository,
        name=args.name,
        backend=args.backend,
        deployment=Deployment(
            args.max_batch,
            args.max_queue_delay_us,
            args.instances,
            args.device,
            image_dtype=args.image_dtype,
            trust=args.trust,
        ),
        libraries=tuple(args.load_library),
    )
    print(f"wrote {model_dir} (config.pbtxt, version 1); launch: {args.repository}/README.md")
    return 0
