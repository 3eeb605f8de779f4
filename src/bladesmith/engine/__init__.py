"""optimize(): the model as given -> passes -> the fastest accurate candidate, and a report.

``search`` runs the passes and keeps what pays; ``trial`` tries one pass (applied,
verified, timed, recorded); ``inputs`` normalises what the user gives; ``reference``
holds the model's own outputs (and under rounding noise) that every candidate is
verified against; ``result`` assembles the spec and the report (``bladesmith.progress``
shows the step in progress).
"""

from bladesmith.engine.inputs import load_model_file
from bladesmith.engine.search import optimize

__all__ = ["load_model_file", "optimize"]
