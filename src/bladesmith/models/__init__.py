"""Adapters that turn model families into fixed-shape pipelines for bladesmith's passes."""

from bladesmith.models.retinanet import (
    DetectionsAsList,
    RetinaNetPipeline,
    build_retinanet,
    is_retinanet,
)

__all__ = ["DetectionsAsList", "RetinaNetPipeline", "build_retinanet", "is_retinanet"]
