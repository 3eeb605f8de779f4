"""The optimisation report: PAI-Blade's keys, plus how it was timed and verified.

PAI-Blade's report has software_context, hardware_context, user_config, diagnosis,
optimizations [{name, status, speedup, pre_run, post_run}], overall {baseline, optimized,
speedup}, model_info, compatibility_list and model_sdk; a reader of that report reads this
one at once. Latencies are numbers in milliseconds rather than PAI-Blade's "9.35 ms"
strings. Added: timing_method, the full timing (percentiles) of the baseline, of the
result and after each pass, the accuracy of each pass against the baseline, the reason
for each pass's fate, and the throughput at each batch size asked for.

Reading a report (``from_dict``, ``render``) needs neither torch nor a GPU.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import metadata

from bladesmith._files import write_atomically

STATUSES = ("kept", "rejected", "failed", "skipped")
_STATUS_STYLE = {"kept": "green", "rejected": "yellow", "failed": "red", "skipped": "dim"}
_STATUS_COLOR = {
    "kept": "#2e7d32",
    "rejected": "#f9a825",
    "failed": "#c62828",
    "skipped": "#9e9e9e",
}


@dataclass
class PassRecord:
    """What one pass did. Latencies in ms, medians (p50) of the best so far (pre_run)
    and of the pass's candidate (post_run), timed in alternating rounds; ``speedup`` is
    pre_run / post_run and ``interval`` its noise interval (``bench.Speedup``);
    ``doubts`` what makes those figures implausible.

    ``accuracy`` is a ``Comparison.to_dict()`` and ``timing`` a ``Timing.to_dict()``; the
    objects themselves are accepted and stored as their dicts.
    """

    name: str
    status: str
    speedup: float | None = None
    pre_run: float | None = None
    post_run: float | None = None
    accuracy: dict | None = None
    reason: str = ""
    timing: dict | None = None
    interval: list[float] | None = None
    doubts: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        self.accuracy = _as_dict(self.accuracy)
        self.timing = _as_dict(self.timing)
        if self.speedup is None and self.pre_run and self.post_run:
            self.speedup = self.pre_run / self.post_run

    def to_dict(self) -> dict:
        return _jsonable({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_dict(cls, data: Mapping) -> PassRecord:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class Report:
    """Everything ``optimize`` did and measured. Timings are ``Timing.to_dict()``s."""

    software_context: list[dict] = field(default_factory=list)
    hardware_context: dict = field(default_factory=dict)
    user_config: dict = field(default_factory=dict)
    diagnosis: dict = field(default_factory=dict)
    optimizations: list[PassRecord] = field(default_factory=list)
    baseline: dict | None = None  # the model as given
    optimized: dict | None = None  # the result
    accuracy: dict | None = None  # the result's outputs against the baseline's
    throughput: list[dict] = field(default_factory=list)  # one Timing per batch size
    # The result against the baseline (a bench.Speedup; its timings are the two above).
    speedup: dict | None = None
    model_info: dict = field(default_factory=dict)
    compatibility_list: list[dict] = field(default_factory=list)
    model_sdk: dict = field(default_factory=dict)
    tolerance: dict = field(default_factory=dict)  # rtol, atol and why, of the outputs
    # The result as save writes it, reloaded in a new process, against the model as
    # given timed alone (engine.saved_speed.SavedSpeed): its format, speedup, interval.
    saved: dict | None = None

    def __post_init__(self):
        self.baseline = _as_dict(self.baseline)
        self.optimized = _as_dict(self.optimized)
        self.accuracy = _as_dict(self.accuracy)
        self.throughput = [_as_dict(timing) for timing in self.throughput]
        self.speedup = _as_dict(self.speedup)
        self.saved = _as_dict(self.saved)
        if self.speedup:
            self.speedup = {
                key: value
                for key, value in self.speedup.items()
                if key not in ("baseline", "candidate")
            }

    @property
    def timing_method(self) -> str | None:
        """ "cuda-events" or "perf_counter", as the baseline was timed."""
        return (self.baseline or {}).get("method")

    @property
    def overall(self) -> dict:
        """PAI-Blade's overall: median latencies (p50) and the speedup, with its interval
        and how it was computed."""
        from bladesmith.bench import STATISTIC

        baseline = (self.baseline or {}).get("p50_ms")
        optimized = (self.optimized or {}).get("p50_ms")
        measured = self.speedup or {}
        speedup = measured.get("ratio")
        if speedup is None and baseline and optimized:
            speedup = baseline / optimized
        return {
            "baseline": baseline,
            "optimized": optimized,
            "speedup": speedup,
            "interval": [measured["low"], measured["high"]] if measured else None,
            "statistic": STATISTIC,
            "measurement": self.speedup,
            "unit": "ms",
            "baseline_timing": self.baseline,
            "optimized_timing": self.optimized,
            "accuracy": self.accuracy,
            "saved": self.saved,
        }

    def to_dict(self) -> dict:
        return _jsonable(
            {
                "software_context": self.software_context,
                "hardware_context": self.hardware_context,
                "user_config": self.user_config,
                "diagnosis": self.diagnosis,
                "optimizations": [record.to_dict() for record in self.optimizations],
                "overall": self.overall,
                "model_info": self.model_info,
                "compatibility_list": self.compatibility_list,
                "model_sdk": self.model_sdk,
                "tolerance": self.tolerance,
                "timing_method": self.timing_method,
                "throughput": self.throughput,
            }
        )

    @classmethod
    def from_dict(cls, data: Mapping) -> Report:
        overall = data.get("overall") or {}
        return cls(
            software_context=list(data.get("software_context") or []),
            hardware_context=dict(data.get("hardware_context") or {}),
            user_config=dict(data.get("user_config") or {}),
            diagnosis=dict(data.get("diagnosis") or {}),
            optimizations=[PassRecord.from_dict(item) for item in data.get("optimizations", [])],
            baseline=overall.get("baseline_timing"),
            optimized=overall.get("optimized_timing"),
            accuracy=overall.get("accuracy"),
            speedup=overall.get("measurement"),
            saved=overall.get("saved"),
            throughput=list(data.get("throughput") or []),
            model_info=dict(data.get("model_info") or {}),
            compatibility_list=list(data.get("compatibility_list") or []),
            model_sdk=dict(data.get("model_sdk") or {}),
            tolerance=dict(data.get("tolerance") or {}),
        )

    def __str__(self) -> str:
        """The JSON report, as PAI-Blade's ``print(report)`` shows it."""
        return self.to_json()

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The report as JSON; also written to ``path`` when given (atomically)."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        if path is not None:
            write_atomically(path, lambda temporary: temporary.write_bytes(text.encode()))
        return text

    def render(self, console=None) -> None:
        """Print the report to a rich console (a new one on stdout by default)."""
        from rich.markup import escape
        from rich.table import Table
        from rich.text import Text

        console = console or output_console()
        model = self.model_info.get("name", "model")
        device = self.hardware_context.get("device", "?")
        hardware = self.hardware_context.get("microarchitecture")
        level = self.user_config.get("level", "?")
        title = f"{model} on {device}" + (f" ({hardware})" if hardware else "")
        console.rule(f"[bold]bladesmith[/] {escape(title)}, level {escape(str(level))}")
        if self.diagnosis.get("message"):
            console.print(Text(str(self.diagnosis["message"])))

        table = Table(title="Passes", title_justify="left", expand=True)
        for column in ("Pass", "Status", "Before ms", "After ms", "Speedup"):
            table.add_column(column, justify="left" if column in ("Pass", "Status") else "right")
        table.add_column("Accuracy", overflow="fold", ratio=3)
        table.add_column("Reason", overflow="fold", ratio=2)
        for record in self.optimizations:
            table.add_row(
                Text(record.name),
                Text(record.status, style=_STATUS_STYLE[record.status]),
                _ms(record.pre_run),
                _ms(record.post_run),
                _times(record.speedup, record.interval),
                Text((record.accuracy or {}).get("summary", "")),
                Text(record.reason),
            )
        console.print(table)

        # The artifact's figure first: a deployment runs the file.
        saved = self.saved or {}
        if saved.get("measured"):
            console.print(
                f"[bold]The artifact[/], saved as {saved['format']} and reloaded in a new "
                f"process: speedup [bold]{_times(saved['ratio'], [saved['low'], saved['high']])}[/]"
            )
        elif saved.get("why"):
            console.print(f"[bold]The artifact[/]: not timed ({escape(saved['why'])})")
        console.print(
            f"In this process: baseline {_latency(self.baseline)} -> optimized "
            f"{_latency(self.optimized)}, speedup "
            f"{_times(self.overall['speedup'], self.overall['interval'])}"
        )
        if self.baseline:
            rounds = len((self.speedup or {}).get("round_ratios") or ()) or 1
            console.print(
                f"Timed with {self.timing_method}: {self.baseline['warmup']} warm-up and "
                f"{self.baseline['iterations']} timed runs each, in {rounds} alternating "
                f"round(s); {escape(self.overall['statistic'])}"
            )
        if self.accuracy:
            verdict = "[green]passed[/]" if self.accuracy.get("passed") else "[red]FAILED[/]"
            if self.accuracy.get("not_verified"):
                verdict = "[red]not verified on these inputs[/]"
            console.print(f"Accuracy {verdict}: {escape(self.accuracy.get('summary', ''))}")
            for source, paths in (self.accuracy.get("sources") or {}).items():
                console.print(Text(f"  tolerance of {_paths(paths)}: {source}"))
        if self.throughput:
            rates = Table(title="Throughput", title_justify="left")
            for column in ("Batch", "p50 ms", "p99 ms", "Items/s"):
                rates.add_column(column, justify="right")
            for timing in self.throughput:
                rates.add_row(
                    str(timing["batch_size"]),
                    _ms(timing["p50_ms"]),
                    _ms(timing["p99_ms"]),
                    f"{timing['throughput']:.1f}",
                )
            console.print(rates)

    def save_chart(self, path: str | os.PathLike) -> None:
        """A PNG bar chart of the latency after each pass, between baseline and result.

        Bars are median latencies (p50) coloured by the pass's status, whiskers to p90;
        a pass with no latency (failed, skipped) has an empty slot labelled with its status.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        rows = [("baseline", "#546e7a", self.baseline, "not measured")]
        for record in self.optimizations:
            # A pass with a post_run but no full timing still gets its bar.
            timing = record.timing or (
                {"p50_ms": record.post_run} if record.post_run is not None else {}
            )
            rows.append((record.name, _STATUS_COLOR[record.status], timing, record.status))
        rows.append(("optimized", "#1565c0", self.optimized, "not measured"))

        figure = Figure(figsize=(max(6.0, 1.1 * len(rows)), 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for position, (_, color, timing, missing) in enumerate(rows):
            median = (timing or {}).get("p50_ms")
            if median is None:
                axes.annotate(missing, (position, 0), ha="center", va="bottom", fontsize=8)
                continue
            high = max(timing.get("p90_ms", median) - median, 0.0)
            axes.bar(position, median, color=color, yerr=[[0.0], [high]], capsize=3)
            axes.annotate(
                f"{median:.2f}",
                (position, median + high),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        axes.set_xticks(range(len(rows)), [row[0] for row in rows], rotation=30, ha="right")
        statuses = dict.fromkeys(record.status for record in self.optimizations)
        if statuses:
            handles = [Patch(color=_STATUS_COLOR[status], label=status) for status in statuses]
            axes.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        axes.set_ylabel("latency, ms (p50; whiskers to p90)")
        name = self.model_info.get("name", "model")
        axes.set_title(f"{name} on {self.hardware_context.get('device', '?')}: latency per pass")
        write_atomically(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120))


def software_context() -> list[dict]:
    """Versions, PAI-Blade style ([{software, version}]); None for what is not installed."""
    from bladesmith import __version__

    context = [
        {"software": "python", "version": platform.python_version()},
        {"software": "bladesmith", "version": __version__},
    ]
    for software, distributions in (
        ("torch", ("torch",)),
        ("torchvision", ("torchvision",)),
        ("onnxruntime", ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml")),
    ):
        context.append({"software": software, "version": _installed_version(distributions)})
    try:
        import torch

        context.append({"software": "cuda", "version": torch.version.cuda})
    except ImportError:
        pass
    return context


def output_console():
    """A rich console on stdout; 160 columns when piped or logged, where rich would
    assume 80 and fold the report's tables into unreadable columns."""
    from rich.console import Console

    class Output(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 here; the command line's handler stops quietly with 141, as
            # for any other closed stdout.
            raise BrokenPipeError

    console = Output()
    return console if console.is_terminal else Output(width=160)


def hardware_context(device=None) -> dict:
    """The device the report's timings ran on (the CPU when ``device`` is None)."""
    import torch

    from bladesmith.devices import cpu_model, with_index

    device = with_index(device if device is not None else "cpu")
    context = {
        "device_type": {"cuda": "gpu"}.get(device.type, device.type),
        "device": str(device),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        context["microarchitecture"] = properties.name
        context["compute_capability"] = f"{properties.major}.{properties.minor}"
        context["memory_gb"] = round(properties.total_memory / 2**30, 1)
    else:
        context["microarchitecture"] = context["cpu_model"]
    return context


def _installed_version(distributions) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _as_dict(value):
    """Timing and Comparison objects are stored as their dicts."""
    return value.to_dict() if hasattr(value, "to_dict") else value


def _jsonable(value):
    """Plain JSON values: dict keys as strings, no NaN/inf (null), other objects as str."""
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(item) for item in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):  # numpy integers too
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return str(value)


def _paths(paths: list[str]) -> str:
    """Outputs judged alike, named: the first three and how many more."""
    shown = ", ".join(paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _times(value: float | None, interval=None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "")


def _latency(timing: dict | None) -> str:
    if not timing:
        return "not measured"
    return (
        f"{timing['p50_ms']:.2f} ms (p50; p90 {timing['p90_ms']:.2f}, "
        f"p99 {timing['p99_ms']:.2f}, mean {timing['mean_ms']:.2f})"
    )
