"""tnt.Model, the thin Keras wrapper (`wrapper`): its fit, evaluate and predict (`loops`), how it
feeds its steps (`inputs`), and what it checks so that every rank trains alike (`checks`)."""

from tarantella.model.wrapper import Model, ParallelStrategy, Sequential

__all__ = ["Model", "ParallelStrategy", "Sequential"]
