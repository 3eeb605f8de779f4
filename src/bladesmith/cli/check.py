"""`bladesmith check` and `bladesmith fix`: a model against deployment targets' rules.

    bladesmith check model.onnx --target tensorrt directml [--json]
    bladesmith fix model.onnx fixed.onnx --target tensorrt [--input-shape images:1,3,480,640]

Exit codes:
- 0 clean (fix: written, verified, no errors left).
- 1 errors found (fix: errors remain, or the outputs changed and nothing was written).
- 2 bad input (a file that is not an ONNX model or not a valid graph, an unknown target,
  an output that cannot be written).
- 3 (fix only) written with no errors left, but its outputs could not be compared.
"""

from __future__ import annotations

import argparse
import json
import sys

from bladesmith.cli.args import output_file, readable_file

TARGET_HELP = (
    "tensorrt, tensorrt8, directml, ort-cpu, ort-cuda or all; several separated by "
    "spaces or commas, or the flag repeated"
)
UNVERIFIED = 3
# Nodes named per group of findings in the text output; --json lists every finding.
SHOWN_NODES = 3


def add_parser(subparsers) -> None:
    check = subparsers.add_parser(
        "check",
        help="check an ONNX model against deployment targets' rules",
        description="Report what stops an ONNX model from building or running well on "
        "each target: rule id, severity, node and a fix hint. Exit 0 clean, 1 errors, "
        "2 not a model.",
    )
    check.add_argument("model", type=readable_file, help="the .onnx file")
    _add_common(check)
    check.set_defaults(func=_run_check)

    fix = subparsers.add_parser(
        "fix",
        help="rewrite an ONNX model to pass a target's rules, then check it again",
        description="Fold constant shape subgraphs, rewrite float shape arithmetic as "
        "integers where exact, drop unused initializers, convert the opset, verify the "
        "outputs in ONNX Runtime, and report what is left. Exit 0 fixed and verified, "
        "1 errors remain or outputs changed, 2 bad input, 3 fixed but not verified.",
    )
    fix.add_argument("model", type=readable_file, help="the .onnx file to fix (left unchanged)")
    fix.add_argument("output", type=output_file(".onnx"), help="where to write the fixed model")
    _add_common(fix)
    fix.add_argument(
        "--input-shape",
        action=_InputShapes,
        default={},
        type=_input_shape,
        metavar="NAME:D0,D1,...",
        help="make a dynamic input static (repeat for several inputs, each once)",
    )
    fix.add_argument(
        "--no-verify",
        action="store_true",
        help="do not compare the two models' outputs in ONNX Runtime",
    )
    fix.set_defaults(func=_run_fix)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        "-t",
        action="extend",
        nargs="+",
        required=True,
        metavar="TARGET",
        help=TARGET_HELP,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _run_check(args) -> int:
    from bladesmith.onnx.checker import NotAModelError, check, has_errors, load_model
    from bladesmith.onnx.targets import UnknownTargetError

    try:
        model = load_model(args.model)
        findings = check(model, args.target)
    except (NotAModelError, UnknownTargetError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([finding.to_dict() for finding in findings], indent=2))
    else:
        _print_findings(findings, _op_types(model, findings))
        errors = sum(finding.severity == "error" for finding in findings)
        print(f"{len(findings)} findings, {errors} errors")
    return 1 if has_errors(findings) else 0


def _run_fix(args) -> int:
    from bladesmith.onnx.checker import NotAModelError, has_errors, load_model
    from bladesmith.onnx.fixer import FixError, InvalidInputError, fix
    from bladesmith.onnx.targets import UnknownTargetError

    try:
        result = fix(
            args.model,
            args.output,
            args.target,
            input_shapes=args.input_shape,
            verify=not args.no_verify,
        )
    except (NotAModelError, UnknownTargetError, InvalidInputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except FixError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for rewrite in result.applied:
            print(f"applied: {rewrite.kind}{_nodes(rewrite.nodes)}: {rewrite.detail}")
        if not result.applied:
            print("applied: nothing (no rewrite matched)")
        verification = result.verification
        reason = f" ({verification.reason})" if verification.reason else ""
        print(f"verification: {verification.status}{reason}")
        fixed = load_model(result.output_path)
        _print_findings(result.remaining, _op_types(fixed, result.remaining))
        print(f"wrote {result.output_path}; {len(result.remaining)} findings remain")
    if result.passed:
        return 0
    return 1 if has_errors(result.remaining) else UNVERIFIED


def _op_types(model, findings) -> dict[str, str]:
    """Node label (as findings name nodes) -> operator type; none when ``findings`` (the
    model's check) say it is not a valid graph, which may have no nodes to view."""
    from bladesmith.onnx.checker import graph_view
    from bladesmith.onnx.rules.validity import RULE

    if any(finding.rule == RULE for finding in findings):
        return {}
    view = graph_view(model)
    return {view.label(node): node.op_type for node in view.all_nodes()}


def _print_findings(findings, op_types: dict[str, str]) -> None:
    """One block per (severity, target, rule, operator): how many nodes, the first few
    names, and the first finding's message, hint and source."""
    groups: dict[tuple, list] = {}
    for finding in findings:
        operator = op_types.get(finding.node or "", "")
        key = (finding.severity, finding.target, finding.rule, operator or finding.message)
        groups.setdefault(key, []).append(finding)
    for (severity, target, rule, _), members in groups.items():
        first = members[0]
        nodes = _nodes([member.node for member in members if member.node])
        operator = op_types.get(first.node or "", "")
        count = f" {operator} x{len(members)}" if len(members) > 1 else ""
        print(f"{severity}: {target}: {rule}{count}{nodes}: {first.message}")
        print(f"  hint: {first.hint}")
        if first.source:
            print(f"  source: {first.source}")


def _nodes(names) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:SHOWN_NODES])
    more = f" and {len(names) - SHOWN_NODES} more" if len(names) > SHOWN_NODES else ""
    return f" [{shown}{more}]"


def _input_shape(spec: str) -> tuple[str, list[int]]:
    name, _, dims = spec.rpartition(":")
    try:
        shape = [int(dim) for dim in dims.split(",")]
    except ValueError:
        shape = []
    if not name or not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"want NAME:D0,D1,... with integers >= 1, got {spec!r}")
    return name, shape


class _InputShapes(argparse.Action):
    """--input-shape NAME:DIMS, repeated, as {name: dims}; a name given twice is refused
    (which one was meant is not for fix to guess)."""

    def __call__(self, parser, namespace, value, option_string=None):
        name, dims = value
        shapes = dict(getattr(namespace, self.dest))
        if name in shapes:
            given = ",".join(map(str, shapes[name]))
            raise argparse.ArgumentError(
                self,
                f"{name} given twice ({name}:{given} and {name}:{','.join(map(str, dims))}); "
                "give each input once",
            )
        setattr(namespace, self.dest, {**shapes, name: dims})
