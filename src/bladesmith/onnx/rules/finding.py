"""The unit of a check's answer: one problem, on one node, for one target."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """One rule's verdict on one node (or on the whole model, where node is None).

    rule: stable id, e.g. "float-shape-arithmetic" (listed in docs/onnx.md's
        "Rules").
    severity: "error" (will not build or run), "warning" (runs, but slower or fragile),
        "info" (worth knowing, e.g. a build needs an optimization profile).
    source: where the fact came from, when it is data rather than a rule of the target
        (e.g. which operator list was consulted).
    related: other nodes involved, e.g. the float nodes on the path into a shape input.
    """

    rule: str
    severity: str
    target: str
    node: str | None
    message: str
    hint: str
    source: str | None = None
    related: tuple[str, ...] = ()

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["related"] = list(self.related)
        return data

    def summary(self) -> str:
        """One line: severity, target, rule, node and message."""
        where = f" [{self.node}]" if self.node else ""
        return f"{self.severity}: {self.target}: {self.rule}{where}: {self.message}"
