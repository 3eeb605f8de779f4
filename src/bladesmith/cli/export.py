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
    at_least,
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
    parser.add_argument("--opset", type=at_least(7), default=17, help="ONNX opset (default 17)")
    parser.add_argument(
        "--custom-ops",
        choices=("domain", "standard"),
        default="domain",
        help=(
            "domain: one ai.onnx.contrib node per operator, run by bladesmith.onnx.session; "
            "standard: standard ONNX only, for any ONNX Runtime provider and TensorRT "
            "(default domain)"
        ),
    )
    parser.add_argument(
        "--input-size",
        type=input_size,
        default=(480, 640),
        metavar="HxW",
        help="image height and width (default 480x640)",
    )
    parser.add_argument("--batch", type=at_least(1), default=1, help="batch size (default 1)")
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
    parser.set_defaults(func=run)
    _add_triton_parser(formats)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bladesmith.models.images import sample_images
    from bladesmith.onnx.exporter import export

    model, output_names = _load_model(args)
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

    model = load_model(args.model, args.input_size, args.weights, args.num_classes)
    family = family_of(model)
    if family is None:
        return model, None
    return family.adapt(model, args.input_size).eval(), list(family.output_names)


def _check_runs(model, images, args) -> None:
    """A model file run once on the images before the export: when it fails there, the
    exporter's message would bury the cause in its stack and name neither the file nor
    the flags to change."""
    import torch

    from bladesmith._files import first_line
    from bladesmith.cli.models import BUILTIN_MODELS, DETECTORS
    from bladesmith.errors import BladesmithError

    if args.model in BUILTIN_MODELS or args.model in DETECTORS:  # built for the size
        return
    try:
        with torch.no_grad():
            model(images)
    except Exception as error:
        height, width = args.input_size
        raise BladesmithError(
            f"{args.model}: the model failed on images of shape {list(images.shape)}: "
            f"{first_line(error)}; give --input-size (now {height}x{width}) and --batch (now "
            f"{args.batch}) that the model takes"
        ) from error


def _add_triton_parser(formats) -> None:
    parser = formats.add_parser(
        "triton",
        help="a Triton model repository for a saved artifact",
        description=(
            "Write REPO_DIR/NAME/config.pbtxt and the version folder for Triton Inference "
            "Server, and REPO_DIR/README.md with the launch command. Backends: python (any "
            "artifact, dynamic batching into its batch size; the default for .pt2), "
            "pytorch_libtorch (TorchScript .pt, bladesmith's operator library beside it, to "
            "LD_PRELOAD) and onnxruntime (standard ONNX)."
        ),
    )
    parser.add_argument("artifact", metavar="ARTIFACT", help=".pt2, .pt or .onnx artifact")
    parser.add_argument("repository", metavar="REPO_DIR", help="model repository folder")
    parser.add_argument("--name", help="model name (default: the file's stem)")
    parser.add_argument(
        "--backend",
        choices=("python", "pytorch_libtorch", "onnxruntime"),
        help="default: pytorch_libtorch for .pt, onnxruntime for .onnx, python for .pt2",
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
        ),
        libraries=tuple(args.load_library),
    )
    print(f"wrote {model_dir} (config.pbtxt, version 1); launch: {args.repository}/README.md")
    return 0
