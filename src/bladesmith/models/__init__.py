"""The built-in models (``catalog``: the list of them, each built by its family, and
the loader of a state-dict file for all of them) and a user's state-dict file
(``weights``). ``build_retinanet`` is the Python entry to the default one; torch is
imported on its first use."""


def __getattr__(name: str):
    if name == "build_retinanet":
        from bladesmith.models.catalog import build_retinanet

        return build_retinanet
    raise AttributeError(f"module 'bladesmith.models' has no attribute {name!r}")


__all__ = ["build_retinanet"]
