"""The backends: one global step per Keras backend (TensorFlow, JAX, torch), each in a folder of its
own behind the `Step` interface of `base.py`, and the arithmetic they share (`fusion.py`,
`loss_terms.py`). `step_class` is the one place that asks Keras which backend runs.
"""

from tarantella.common import config

SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")
_INSTALL_HINTS = {
    "tensorflow": "pip install 'tarantella[cpu]' (or 'tarantella[gpu]' on GPU nodes)",
    "jax": "pip install 'tarantella[cpu,jax]'",
    # PyPI's torch wheel brings the CUDA libraries (about 4 GB more); PyTorch's CPU index does not.
    "torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install 'tarantella[cpu]'",
}


def check_supported():
    """Raises ImportError where Keras' backend is not installed, or is one tarantella cannot distribute."""
    try:
        import keras
        backend = keras.backend.backend()
    except ModuleNotFoundError as missing:
        if missing.name not in _INSTALL_HINTS:
            raise
        raise ImportError(f"tarantella with Keras' {missing.name!r} backend needs {missing.name}, which is not "
                          f"installed. Install it with tarantella: {_INSTALL_HINTS[missing.name]}.") from None
    if backend not in SUPPORTED_BACKENDS:
        raise ImportError(f"tarantella does not support Keras' {backend!r} backend yet; it supports "
                          f"{', '.join(repr(b) for b in SUPPORTED_BACKENDS)}. Set KERAS_BACKEND to one of them "
                          "before importing keras.")


def step_class():
    """The Step subclass of the backend Keras runs on."""
    import keras  # not at import: tarantella/__init__.py explains a missing backend module first

    backend = keras.backend.backend()
    if backend == "jax":
        from tarantella.backends.jax.step import JaxStep
        return JaxStep
    if backend == "torch":
        from tarantella.backends.torch.step import TorchStep
        return TorchStep
    from tarantella.backends.tensorflow.step import TensorFlowStep
    return TensorFlowStep


def for_model(communicator, reducer, model):
    """The global step of `model` for the backend Keras runs on.

    Args:
        communicator: the rank's communicator (`runtime.world.init()`).
        reducer: the gradient reducer (`runtime.world.gradient_reducer()`).
        model: the wrapped Keras model.

    Returns:
        a `Step`.
    """
    return step_class()(communicator, reducer, model, fusion_threshold_bytes())


def fusion_threshold_bytes():
    """The smallest gradient bucket: TNT_FUSION_THRESHOLD where the user set it, else the automatic
    one for this job's ranks, nodes and slowest link (`fusion.automatic_threshold_bytes`), the same
    on every rank."""
    return fusion_threshold()[0]


def fusion_threshold():
    """(the fusion threshold in bytes, how it was chosen, in words for the timeline's report)."""
    chosen = config.fusion_threshold_bytes()
    if chosen is not None:
        return chosen, "set by TNT_FUSION_THRESHOLD"
    from tarantella.backends import fusion
    from tarantella.runtime import world
    ranks, link = world.init().size, world.slowest_link()
    if link is None:
        return fusion.automatic_threshold_bytes(ranks, 1), "automatic, one node"
    return (fusion.automatic_threshold_bytes(ranks, world.node_share().nodes, link.latency_s, link.bytes_per_s),
            f"automatic, for {ranks} ranks on a link measured at {link.describe()}")
