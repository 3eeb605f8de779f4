"""`bladesmith check` and `bladesmith fix`: a model against deployment targets' rules.

    bladesmith check model.onnx --target tensorrt --target directml [--json]
    bladesmith fix model.onnx fixed.onnx --target tensorrt [--input-shape images:1,3,480,640]

Both exit 1 when errors remain (for fix: or when the outputs changed), else 0.
"""

from __future__ import annotations

import argparse
import json

TARGET_HELP = (
    "tensorrt, tensorrt8, directml, ort-cpu, ort-cuda or all; repeat or separate with "
    "commas for several"
)


def add_parser(subparsers) -> None:
    check = subparsers.add_parser(
        "check",
        help="check an ONNX model against deployment targets' rules",
        description="Report what stops an ONNX model from building or running well on "
        "each target: rule id, severity, node and a fix hint.",
    )
    check.add_argument("model", help="the .onnx file")
    _add_common(check)
    check.set_defaults(func=_run_check)

    fix = subparsers.add_parser(
        "fix",
        help="rewrite an ONNX model to pass a target's rules, then check it again",
        description="Fold constant shape subgraphs, rewrite float shape arithmetic as "
        "integers where exact, convert the opset, verify the outputs in ONNX Runtime, "
        "and report what is left.",
    )
    fix.add_argument("model", help="the .onnx file to fix (left unchanged)")
    fix.add_argument("output", help="where to write the fixed model")
    _add_common(fix)
    fix.add_argument(
        "--input-shape",
        action="append",
        default=[],
        type=_input_shape,
        metavar="NAME:D0,D1,...",
        help="make a dynamic input static (repeat for several inputs)",
    )
    fix.add_argument(
        "--no-verify",
        action="store_true",
        help="do not compare the two models' outputs in ONNX Runtime",
    )
    fix.set_defaults(func=_run_fix)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", "-t", action="append", required=True, metavar="TARGET", help=TARGET_HELP
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _run_check(args) -> int:
    from bladesmith.onnx.checker import check, has_errors

    findings = check(args.model, args.target)
    if args.json:
        print(json.dumps([finding.to_dict() for finding in findings], indent=2))
    else:
        _print_findings(findings)
        errors = sum(finding.severity == "error" for finding in findings)
        print(f"{len(findings)} findings, {errors} errors")
    return 1 if has_errors(findings) else 0


def _run_fix(args) -> int:
    from bladesmith.onnx.fixer import fix

    result = fix(
        args.model,
        args.output,
        args.target,
        input_shapes=dict(args.input_shape),
        verify=not args.no_verify,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for rewrite in result.applied:
            nodes = f" [{', '.join(rewrite.nodes)}]" if rewrite.nodes else ""
            print(f"applied: {rewrite.kind}{nodes}: {rewrite.detail}")
        if not result.applied:
            print("applied: nothing (no rewrite matched)")
        verification = result.verification
        reason = f" ({verification.reason})" if verification.reason else ""
        print(f"verification: {verification.status}{reason}")
        _print_findings(result.remaining)
        print(f"wrote {result.output_path}; {len(result.remaining)} findings remain")
    return 0 if result.passed else 1


def _print_findings(findings) -> None:
    for finding in findings:
        print(finding.summary())
        print(f"  hint: {finding.hint}")
        if finding.source:
            print(f"  source: {finding.source}")


def _input_shape(spec: str) -> tuple[str, list[int]]:
    name, _, dims = spec.rpartition(":")
    try:
        shape = [int(dim) for dim in dims.split(",")]
    except ValueError:
        shape = []
    if not name or not shape or min(shape) < 0:
        raise argparse.ArgumentTypeError(f"want NAME:D0,D1,... with integers >= 0, got {spec!r}")
    return name, shape
