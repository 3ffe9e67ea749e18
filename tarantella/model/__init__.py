"""tnt.Model, the thin Keras wrapper (`wrapper`): its fit, evaluate and predict (`loops`), how it
feeds its steps (`inputs`), what it checks so that every rank trains alike (`checks`), and its
synchronized BatchNormalization (`batch_normalization`)."""

from tarantella.model.wrapper import Model, ParallelStrategy, Sequential

__all__ = ["Model", "ParallelStrategy", "Sequential"]
