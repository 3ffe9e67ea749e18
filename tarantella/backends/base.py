"""The Step interface: what a Keras backend's global step gives `tnt.Model`, what the backend can do,
and the facts of Keras' own trainer on that backend that tarantella mirrors.

One subclass per backend, each in its backend's folder (`tensorflow/`, `jax/`, `torch/`), as Keras
has one trainer per backend; `backends.step_class()` is the one place that picks it. A feature a
backend lacks is a capability below set to False, and `refuse_unless` raises the one refusal that
names the feature and the backend.
"""

import abc

import numpy as np

from tarantella.backends import accumulation


class Step(abc.ABC):
    """A backend's global step: the wrapped model's Keras steps, run on each rank's micro-batch and
    combined over the ranks into the serial step's results.

    Built by `backends.for_model`; `tnt.Model` calls `train`, `test` and `predict` as the backend's
    trainer calls `train_step`, `test_step` and `predict_step`, with the trainer's arguments.
    """

    # How tarantella's messages name the backend.
    backend_name = None

    # -- capabilities: features of tnt.Model this backend's step has ----------------------------
    # A model that overrides train_step or test_step.
    custom_steps = False
    # tnt.keras.callbacks.Callback(aggregate_logs=False): a callback that sees the rank's own logs.
    rank_local_logs = False
    # tnt.optimizers: the gradient sum of a custom training loop (`sum_loop_gradients`).
    custom_training_loops = False
    # XLA may compile the step with its collectives inside. False: XLA cannot compile the host-side
    # collectives, so on several ranks Keras' function stays uncompiled and the step has XLA
    # compile the parts between its collectives (`compile_between_collectives`).
    collectives_inside_xla = True
    # The widest float the step computes in: synchronized BatchNormalization's moment sums and the
    # metric sums are formed in it (backends/moments.py, metric_sums.py).
    widest_float = "float64"

    # -- facts of Keras' trainer on this backend --------------------------------------------------
    # Keras' fit builds an unbuilt model (or its compiled loss and metrics) from the first batch of
    # one extra pass over a dataset, which draws a shuffle order of its own.
    keras_builds_from_an_extra_pass = False
    # Keras' steps take NumPy arrays (not tensors) as the batch.
    keras_steps_take_arrays = False
    # Keras shuffles arrays with an op whose unseeded draws differ from process to process.
    keras_array_shuffle_differs_per_process = False
    # Keras builds (and loads) a BatchNormalization layer with synchronized=True.
    keras_accepts_synchronized_batch_normalization = False

    @classmethod
    def keras_iterators_per_epoch(cls, batches_known):
        """How many iterators Keras' fit (without steps_per_epoch) creates on a dataset per epoch.

        One at the start of every epoch on JAX and torch (on torch, the DataLoader over the dataset
        makes the dataset's iterator only when its first batch is asked for)."""
        return 1

    @classmethod
    def refuse_unless(cls, capability, feature, instead, why=""):
        """Raises NotImplementedError where this backend lacks `capability` (an attribute above).

        Args:
            capability: the name of the capability, e.g. "custom_steps".
            feature: what the user asked for, as the message names it.
            instead: what to do instead, one or more sentences.
            why: an optional reason, appended to the first sentence (starting with " (" or ": ").
        """
        if not getattr(cls, capability):
            raise NotImplementedError(
                f"{feature} is not supported on Keras' {cls.backend_name} backend yet{why}. {instead}")

    @classmethod
    def check_platform(cls):
        """Raises NotImplementedError where the backend runs on a device the step cannot serve."""

    @classmethod
    @abc.abstractmethod
    def configure_devices(cls, share, threads):
        """Gives this rank (its place on the node: `share`, a NodeShare) its GPU or `threads` CPU
        threads (None: the frameworks' defaults) in every framework it uses."""

    @classmethod
    def collective_leaf(cls, name, leaf):
        """`leaf` of the values passed to the public collective tnt.`name`, as the collectives take it:
        a TensorFlow tensor or variable, a NumPy array or number, or None."""
        return leaf

    @classmethod
    def sum_loop_gradients(cls, grads, num_samples, loss_reduction, variables, reducer, threshold_bytes, ranks):
        """`tnt.optimizers.allreduce_gradients` on this backend (tarantella/optimizers.py has the
        contract): this rank's `grads` (the backend's arrays or tensors, None entries stay None)
        made the global batch's, each weighted by `num_samples` (or alike, where None) and summed over
        the `ranks` through `reducer` in one fused round (`threshold_bytes`), in the backend's arrays."""
        raise NotImplementedError

    @classmethod
    def host_view(cls, variable):
        """`variable`'s value as a NumPy array on the host, without a copy where the framework allows
        it; valid until the next step changes the variable."""
        return variable.numpy()

    @classmethod
    def snapshot(cls, variables, buffers=None):
        """The values of `variables` as they are now, which later steps cannot change, for a thread
        to read with `np.asarray` while training goes on. `buffers` is an earlier snapshot of the
        same variables that nobody reads any more: its host arrays are reused (allocating and
        faulting in the pages again would double the time the step waits)."""
        # Copied: the next step may reuse the buffers (JAX donates them, torch updates in place).
        views = [cls.host_view(variable) for variable in variables]
        if buffers is None or [(b.shape, b.dtype) for b in buffers] != [(v.shape, v.dtype) for v in views]:
            buffers = [np.empty(view.shape, view.dtype) for view in views]
        for buffer, view in zip(buffers, views):
            np.copyto(buffer, view)
        return buffers

    @classmethod
    @abc.abstractmethod
    def replayed_train_function(cls, model, train_function, replayer):
        """`model`'s train function (`train_function`, as Keras' fit calls it), wrapped for a resumed
        fit that replays an epoch's first steps: while `replayer.over()` is False, a call reads the
        step's batches without training and returns `replayer.replayed(steps)` as the step's logs."""

    # -- the step -----------------------------------------------------------------------------------

    # (metric variable, rank-local copy) pairs while a callback asks for the rank's own values.
    local_metric_state = None

    @abc.abstractmethod
    def train(self, *arguments):
        """The global training step, called as the trainer calls `train_step`."""

    @abc.abstractmethod
    def test(self, *arguments):
        """The global test step, called as the trainer calls `test_step`."""

    @abc.abstractmethod
    def predict(self, *arguments):
        """Every rank's predictions of the global batch, in its order, called as `predict_step`."""

    @abc.abstractmethod
    def optimizers(self):
        """Every optimizer the wrapped model holds, whose gradients the step sums."""

    def locally_accumulating_optimizers(self):
        """The optimizers whose gradient accumulators hold this rank's own part of serial Keras'
        (backends/accumulation.py): those whose micro-steps the step does not sum. Default: every
        accumulating optimizer the model holds."""
        return [o for o in self.optimizers() if accumulation.steps(o)]

    def compile_between_collectives(self, xla):
        """Where the collectives cannot sit inside XLA: whether (`xla`, Keras' resolved
        `jit_compile`) XLA compiles the step's computation between its collectives."""
        if xla:
            raise NotImplementedError(f"XLA between the collectives is not supported on Keras' "
                                      f"{self.backend_name} backend.")

    @abc.abstractmethod
    def wrap_function(self, kind, function):
        """Keras' train, test or predict function (`kind`), wrapped as this backend needs it."""

    @abc.abstractmethod
    def expect_global_batch_size(self, size):
        """Told before fit the global batch size of its data, or None where it varies or is unknown."""

    @abc.abstractmethod
    def expect_unknown_length(self, kind, global_batch_spec):
        """Told the spec of the global batches of `kind` steps whose number is unknown (else None)."""
