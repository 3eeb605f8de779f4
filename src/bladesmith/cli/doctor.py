"""`bladesmith doctor [--json] [--site-dir DIR]`: what this machine can run.

Only argparse is imported here; the doctor, torch and rich are imported when it runs.
"""

from __future__ import annotations

import argparse

from bladesmith.cli.args import existing_folder

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="what this machine can run: versions, devices, providers, toolchains, save "
        "formats, pitfalls",
        description=(
            "Report package versions, devices, ONNX Runtime execution providers, the "
            "toolchain for the custom operators, and known pitfalls with their fixes. "
            "Builds nothing."
        ),
        epilog=(
            "Exit status: 0 when no pitfall has severity error, 1 when at least one does "
            "(warnings and info do not change it)."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--site-dir",
        action="append",
        default=[],
        type=existing_folder,
        metavar="DIR",
        help=(
            "also scan DIR for binary .pth files, e.g. the site-packages of an environment "
            "that no longer starts, or that environment's root (repeatable)"
        ),
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bladesmith.environment import doctor

    result = doctor(site_dirs=args.site_dir)
    formats = save_formats()
    if args.json:
        import json

        print(json.dumps({**result.to_dict(), "formats": formats}, indent=2))
    else:
        from bladesmith.report import output_console

        console = output_console()
        render(result, console)
        render_formats(formats, console)
    return 1 if result.errors else 0


def save_formats() -> list[dict]:
    """Each save format (``runtimes.formats.FORMATS``): its suffix, what it holds, the
    devices it is written for, the Triton backend that serves it, and whether this
    machine can load it (what to install where not)."""
    from bladesmith.runtimes.formats import FORMATS

    return [
        {
            "suffix": suffix,
            "description": each.description,
            "devices": list(each.devices),
            "triton_backend": each.triton_backend or "python",
            "missing": each.missing_package(),
        }
        for suffix, each in FORMATS.items()
    ]


def render_formats(formats: list[dict], console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Save formats", title_justify="left", title_style="bold")
    for column in ("suffix", "holds", "devices", "Triton backend", "loads here"):
        table.add_column(column, overflow="fold")
    for each in formats:
        loads = each["missing"] or "yes"
        row = (each["suffix"], each["description"], ", ".join(each["devices"]))
        table.add_row(*(Text(cell) for cell in (*row, each["triton_backend"], loads)))
    console.print(table)


def render(result, console) -> None:
    """Print a DoctorResult as rich tables."""
    from rich.table import Table
    from rich.text import Text

    def table(title: str, *columns: str) -> Table:
        new = Table(title=title, title_justify="left", title_style="bold")
        for column in columns:
            new.add_column(column, overflow="fold")  # paths stay whole, wrapped
        return new

    def cells(*values) -> list[Text]:  # Text, so that paths with [brackets] are not markup
        return [Text("" if value is None else str(value)) for value in values]

    console.print(Text(f"Platform: {result.platform}"))
    packages = table("Versions", "package", "version", "detail")
    for package in result.packages:
        version = Text(package.version or "not installed")
        if package.version is None:
            version.stylize("dim")
        packages.add_row(Text(package.name), version, Text(package.detail))
    console.print(packages)

    devices = table("Devices", "device", "description", "details")
    for device in result.devices:
        devices.add_row(*cells(device.name, device.description, _device_details(device)))
    console.print(devices)
    providers = ", ".join(result.providers) or "none"
    console.print(Text(f"ONNX Runtime execution providers: {providers}"))

    chain = result.toolchain
    tools = table("Toolchain for the bladesmith operators", "tool", "path", "version", "detail")
    for tool in (chain.compiler, chain.ninja, chain.nvcc):
        tools.add_row(*cells(tool.name, tool.path or "not found", tool.version, tool.detail))
    if chain.torch_cuda and chain.nvcc_cuda:
        verdict = "matches" if chain.nvcc_matches_torch else "does not match"
        tools.add_row(
            *cells("CUDA", "", chain.nvcc_cuda, f"{verdict} torch's CUDA {chain.torch_cuda}")
        )
    ops = chain.ops
    state = "built" if ops.built else "not built" if ops.available else "unknown"
    if ops.loadable is not None:
        state += ", loads" if ops.loadable else ", does not load"
    tools.add_row(*cells("bladesmith ops", ops.path, state, ops.detail))
    console.print(tools)

    if not result.pitfalls:
        console.print(Text("No pitfalls found.", style="green"))
        return
    pitfalls = table("Pitfalls", "severity", "id", "problem", "fix")
    for pitfall in result.pitfalls:
        severity = Text(pitfall.severity, style=_SEVERITY_STYLE.get(pitfall.severity, ""))
        pitfalls.add_row(severity, *cells(pitfall.id, pitfall.message, pitfall.fix))
    console.print(pitfalls)


def _device_details(device) -> str:
    details = []
    if device.compute_capability:
        details.append(f"compute capability {device.compute_capability}")
    if device.total_memory:
        details.append(f"{device.total_memory / 2**30:.1f} GiB")
    if device.logical_cores:
        details.append(f"{device.logical_cores} logical cores")
    if device.torch_threads:
        details.append(f"torch threads {device.torch_threads}")
    return ", ".join(details)
