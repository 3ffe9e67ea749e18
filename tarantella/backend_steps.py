"""The step module for Keras' backend: the one part of tarantella that differs per backend.

A step module makes the wrapped model's Keras steps global: its object, built by
`for_model`, has `train`, `test` and `predict` (called as the backend's trainer calls
`train_step`, `test_step` and `predict_step`), `optimizers()`, `local_metric_state`,
`wrap_function(kind, function)`, which wraps Keras' train, test or predict function (to gather
predictions outside the compiled step, say), `expect_global_batch_size(size)`, told before fit the
global batch size of its data (or None), and `expect_unknown_length(kind, spec)`, told the spec of
global batches whose number TensorFlow cannot tell (or None). Everything
around the steps (data splitting, the communicator, callbacks, saving, the launcher) is shared.
"""

from tarantella.common import config

SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")
_INSTALL_HINTS = {
    "tensorflow": "pip install 'tarantella[cpu]' (or 'tarantella[gpu]' on GPU nodes)",
    "jax": "pip install 'tarantella[cpu,jax]'",
    # PyPI's torch wheel brings the CUDA libraries (about 4 GB more); PyTorch's CPU index does not.
    "torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install 'tarantella[cpu]'",
}


def check_supported(backend):
    """Raises ImportError for a Keras backend tarantella cannot distribute."""
    if backend not in SUPPORTED_BACKENDS:
        raise ImportError(_unsupported(backend))


def missing_module_error(name):
    """The ImportError for Keras failing to import its backend's module `name`, or None when
    `name` is no backend."""
    if name in _INSTALL_HINTS:
        return ImportError(f"tarantella with Keras' {name!r} backend needs {name}, which is not installed. "
                           f"Install it with tarantella: {_INSTALL_HINTS[name]}.")
    return None


def _unsupported(backend):
    return (f"tarantella does not support Keras' {backend!r} backend yet; it supports "
            f"{', '.join(repr(b) for b in SUPPORTED_BACKENDS)}. Set KERAS_BACKEND to one of them "
            "before importing keras.")


def for_model(communicator, reducer, model):
    """The distributed step of `model` for the backend Keras runs on."""
    import keras

    threshold = config.fusion_threshold_bytes()
    if keras.backend.backend() == "jax":
        from tarantella import jax_step
        return jax_step.JaxStep(communicator, reducer, model, threshold)
    if keras.backend.backend() == "torch":
        from tarantella import torch_step
        return torch_step.TorchStep(communicator, reducer, model, threshold)
    from tarantella import distributed_step, gradients
    return distributed_step.DistributedStep(communicator, model,
                                            gradients.GradientAllreduce(reducer, threshold))
