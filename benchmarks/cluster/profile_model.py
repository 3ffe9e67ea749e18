"""Profile models: a measured profile's layer structure and weight sizes, with each layer's
forward and backward compute replaced by waiting for its measured time.

A profile (benchmarks/profiles/*.json, made by `emulated_cluster.py profile`) lists the real
model's layers in forward order with their trainable weight shapes and measured times. Layers
without weights are merged into the nearest earlier layer with weights (their backward time
comes before that layer's in backprop, so its gradients are ready just as late as in the real
model). Each merged stage is one Keras layer holding one 1-D weight per real weight, of the real
size divided by the byte scale (at least one element); its forward waits for the stage's forward
time, its backward for its backward time and then yields its weights' gradients (computed from
the incoming gradient, never constants), so the gradients appear in backprop order at the times
the real model would produce them, and tarantella's buckets, worker, ring and MPI do the rest.
The waiting is a sleep: it takes no CPU, so 16 ranks fit on 2 cores.

The stage's activations are a (batch, 4) float32 tensor: what travels between ranks is gradients only.

Nothing here imports Keras or a framework before `build` is called, and `build` runs on Keras 3
(TensorFlow, JAX or PyTorch) and on Keras 2 (tf.keras of TensorFlow 2.15, in Horovod's
environment: benchmarks/cluster/horovod_worker.py), with the same TensorFlow stage for both.
"""

import functools
import json
import math
import os
import time

WIDTH = 4


def load(path_or_name):
    path = path_or_name
    if not os.path.exists(path):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles",
                            f"{path_or_name}.cpu.json")
    with open(path) as file:
        return json.load(file)


def stages(profile):
    """[(name, [weight element counts], forward_s, backward_s)] with weightless layers merged into the
    nearest earlier stage (those before the first weighted layer into the first), and so are layers
    whose weights are all vectors (a BatchNormalization's scale and shift after its convolution): its
    gradients are then ready with the convolution's, a layer's backward time later than in the real
    model, and the model has half the stages to trace."""
    merged, pending_forward, pending_backward = [], 0.0, 0.0
    for layer in profile["layers"]:
        sizes = [math.prod(shape) for shape in layer["weights"]]
        if sizes and merged and all(len(shape) == 1 for shape in layer["weights"]):
            merged[-1][1] += sizes
            merged[-1][2] += layer["forward_s"]
            merged[-1][3] += layer["backward_s"]
        elif sizes:
            merged.append([layer["name"], sizes, layer["forward_s"] + pending_forward,
                           layer["backward_s"] + pending_backward])
            pending_forward = pending_backward = 0.0
        elif merged:
            merged[-1][2] += layer["forward_s"]
            merged[-1][3] += layer["backward_s"]
        else:
            pending_forward += layer["forward_s"]
            pending_backward += layer["backward_s"]
    if merged:
        merged[-1][2] += pending_forward
        merged[-1][3] += pending_backward
    return [tuple(stage) for stage in merged]


def scaled_sizes(sizes, scale):
    return [max(1, round(size / scale)) for size in sizes]


# Every wait goes through here; a test may set `on_wait` to see which stage waited for how long.
on_wait = None


def wait(seconds, what):
    if on_wait is not None:
        on_wait(what, seconds)
    time.sleep(seconds)


def _stage_tensorflow(keras):
    import tensorflow as tf

    def waiting(seconds, what, array):
        wait(seconds, what)
        return array

    def apply(layer, x, weights):
        forward_s, backward_s, name = layer.forward_s, layer.backward_s, layer.name

        @tf.custom_gradient
        def stage(x, *weights):
            # Not stateful: TensorFlow would otherwise run every such op in program order, and
            # the buckets' hand-overs (stateful) only after the whole backward pass.
            y = tf.numpy_function(functools.partial(waiting, forward_s, (name, "forward")), [x], tf.float32,
                                  stateful=False)
            y.set_shape(x.shape)

            def backward(dy):
                dx = tf.numpy_function(functools.partial(waiting, backward_s, (name, "backward")), [dy],
                                       tf.float32, stateful=False)
                dx.set_shape(dy.shape)
                g = tf.reduce_mean(dx) * GRADIENT_FACTOR
                return [dx] + [tf.fill(tf.shape(w), g) for w in weights]
            return y, backward

        return stage(x, *[tf.identity(w) for w in weights])
    return apply


def _stage_jax(keras, batch_mesh=None):
    import jax
    import jax.numpy as jnp

    def waiting(seconds, what, x):
        def host(array):
            wait(seconds, what)
            return array

        def wait_on(x):
            return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        if batch_mesh is None:
            return wait_on(x)
        # Under a batch-sharded mesh (Keras' DataParallel) each process waits on its own rows: a bare
        # host callback would be placed on one device, and every stage's rows sent there and back.
        return jax.shard_map(wait_on, mesh=batch_mesh, in_specs=rows, out_specs=rows)(x)

    def weight_gradients(dx, shapes):
        def of_rows(dx):
            g = jnp.mean(dx) * GRADIENT_FACTOR
            return tuple(jnp.full(shape, g, dtype) for shape, dtype in shapes)
        if batch_mesh is None:
            return of_rows(dx)
        # Each process's gradients of its own rows, averaged over the mesh as XLA averages a real
        # layer's: one allreduce of each weight's size (from a global mean alone, XLA would send a
        # scalar and broadcast it).
        return jax.shard_map(lambda dx: tuple(jax.lax.pmean(g, batch_axis) for g in of_rows(dx)), mesh=batch_mesh,
                             in_specs=rows, out_specs=jax.sharding.PartitionSpec())(dx)

    if batch_mesh is not None:
        batch_axis = batch_mesh.axis_names[0]
        rows = jax.sharding.PartitionSpec(batch_axis)

    def apply(layer, x, weights):
        forward_s, backward_s, name = layer.forward_s, layer.backward_s, layer.name
        shapes = [(tuple(w.shape), w.dtype) for w in weights]

        @jax.custom_vjp
        def stage(x, *weights):
            return waiting(forward_s, (name, "forward"), x)

        def forward(x, *weights):
            return stage(x, *weights), None

        def backward(_, dy):
            dx = waiting(backward_s, (name, "backward"), dy)
            return (dx,) + weight_gradients(dx, shapes)

        stage.defvjp(forward, backward)
        return stage(x, *weights)
    return apply


def _stage_torch(keras):
    import torch

    class Stage(torch.autograd.Function):
        @staticmethod
        def forward(context, forward_s, backward_s, name, x, *weights):
            wait(forward_s, (name, "forward"))
            context.backward_s, context.name = backward_s, name
            context.shapes = [w.shape for w in weights]
            return x.clone()

        @staticmethod
        def backward(context, dy):
            wait(context.backward_s, (context.name, "backward"))
            dx = dy.clone()
            g = dx.mean() * GRADIENT_FACTOR
            return (None, None, None, dx) + tuple(g.expand(shape).clone() for shape in context.shapes)

    def apply(layer, x, weights):
        return Stage.apply(layer.forward_s, layer.backward_s, layer.name, x, *weights)
    return apply


GRADIENT_FACTOR = 1e-6  # each weight's gradient: the mean of the incoming gradient times this


def build(profile, scale, time_factor=1.0, batch_mesh=None):
    """The profile model on the current Keras backend (TensorFlow, JAX or PyTorch); on JAX,
    `batch_mesh` is the jax.sharding.Mesh whose first axis Keras' DataParallel shards the batch on."""
    import keras

    if keras.backend.backend() == "jax":
        apply = _stage_jax(keras, batch_mesh)
    else:
        apply = {"tensorflow": _stage_tensorflow, "torch": _stage_torch}[keras.backend.backend()](keras)

    class Stage(keras.layers.Layer):
        def __init__(self, sizes, forward_s, backward_s, **kwargs):
            super().__init__(**kwargs)
            self.sizes, self.forward_s, self.backward_s = sizes, forward_s, backward_s
            self.parts = [self.add_weight(shape=(size,), initializer="zeros", name=f"w{index}")
                          for index, size in enumerate(sizes)]

        def call(self, x):
            return apply(self, x, [_read(w) for w in self.parts])

        def compute_output_shape(self, shape):
            return shape

    inputs = keras.Input((WIDTH,))
    x = inputs
    for index, (name, sizes, forward_s, backward_s) in enumerate(stages(profile)):
        x = Stage(scaled_sizes(sizes, scale), forward_s * time_factor, backward_s * time_factor,
                  name=f"stage{index}")(x)
    return keras.Model(inputs, x, name=profile["model"])


build_tensorflow = build  # the name the first version had


def _read(variable):
    """A weight's current value: Keras 3's variables hold it as `.value`, Keras 2's (tf.Variable)
    return it from `.value()`."""
    value = variable.value
    return value() if callable(value) else value


def data(global_batch, steps=8):
    import numpy as np
    rng = np.random.default_rng(0)
    return (rng.random((global_batch * steps, WIDTH), dtype=np.float32),
            np.zeros((global_batch * steps, WIDTH), np.float32))
