"""The four real models whose layer structure and weight sizes the profile models copy, and the
per-layer timing that makes their profiles (`emulated_cluster.py profile`).

ResNet-50 and VGG-16 are keras.applications' (224x224 inputs, 1000 classes). BERT-base (12
blocks, width 768, 12 heads, 3072 hidden, 30522 tokens, 512 positions, a pooler and a 2-class
head) and the Transformer (big) (6 encoder and 6 decoder blocks, width 1024, 16 heads, 4096
hidden, one 32768-token embedding shared by encoder, decoder and the output projection, as in
"Attention Is All You Need") are built here from Keras layers, one custom layer per sub-layer,
so that every layer of every model takes one input (a tensor or a list) and can be timed alone.

Timing (TensorFlow, eager, on this machine's CPU): one forward pass of the whole model keeps
every layer's input; then each layer alone runs forward, and forward with backward (gradients
of its inputs and its trainable weights for an all-ones output gradient), `REPEATS` times
after one warm-up; the medians are the layer's forward time and (the difference) its backward
time. Eager dispatch adds some tens of microseconds per op against a compiled step.
"""

import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

REPEATS = 3


def _keras():
    import keras
    return keras


def resnet50():
    keras = _keras()
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)


def vgg16():
    keras = _keras()
    return keras.applications.VGG16(weights=None, input_shape=(224, 224, 3), classes=1000)


def _layers():
    keras = _keras()
    ops = keras.ops

    class Embed(keras.layers.Layer):
        """Token (+ position, + segment) embeddings with LayerNormalization (BERT) or scaling (Transformer)."""

        def __init__(self, vocabulary, width, positions=0, segments=0, normalize=False, **kw):
            super().__init__(**kw)
            self.tokens = keras.layers.Embedding(vocabulary, width)
            self.positions = keras.layers.Embedding(positions, width) if positions else None
            self.segments = keras.layers.Embedding(segments, width) if segments else None
            self.norm = keras.layers.LayerNormalization() if normalize else None
            self.width = width

        def call(self, ids):
            x = self.tokens(ids)
            if self.positions is not None:
                x = x + self.positions(ops.arange(ops.shape(ids)[-1]))
            if self.segments is not None:
                x = x + self.segments(ops.zeros_like(ids))
            return self.norm(x) if self.norm is not None else x * (self.width ** 0.5)

    class Attention(keras.layers.Layer):
        """Multi-head attention, residual and LayerNormalization; input x, or [x, memory] (cross)."""

        def __init__(self, heads, width, causal=False, **kw):
            super().__init__(**kw)
            self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
            self.norm = keras.layers.LayerNormalization()
            self.causal = causal

        def call(self, inputs):
            x, memory = (inputs, inputs) if not isinstance(inputs, (list, tuple)) else inputs
            return self.norm(x + self.attention(x, memory, use_causal_mask=self.causal))

    class FeedForward(keras.layers.Layer):
        def __init__(self, hidden, width, activation, **kw):
            super().__init__(**kw)
            self.inner = keras.layers.Dense(hidden, activation=activation)
            self.outer = keras.layers.Dense(width)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return self.norm(x + self.outer(self.inner(x)))

    class SharedProjection(keras.layers.Layer):
        """Logits through the transposed shared embedding (its weights belong to the Embed layer)."""

        def __init__(self, embedding, **kw):
            super().__init__(**kw)
            self.embedding = embedding

        def call(self, x):
            return ops.matmul(x, ops.transpose(self.embedding.tokens.embeddings))

    return Embed, Attention, FeedForward, SharedProjection


def bert_base(length=128):
    keras = _keras()
    Embed, Attention, FeedForward, _ = _layers()
    ids = keras.Input((length,), dtype="int32")
    x = Embed(30522, 768, positions=512, segments=2, normalize=True, name="embeddings")(ids)
    for block in range(12):
        x = Attention(12, 768, name=f"block{block}_attention")(x)
        x = FeedForward(3072, 768, "gelu", name=f"block{block}_ffn")(x)
    pooled = keras.layers.Dense(768, activation="tanh", name="pooler")(x[:, 0])
    return keras.Model(ids, keras.layers.Dense(2, name="classifier")(pooled), name="bert_base")


def transformer_big(length=64):
    keras = _keras()
    Embed, Attention, FeedForward, SharedProjection = _layers()
    source = keras.Input((length,), dtype="int32")
    target = keras.Input((length,), dtype="int32")
    embed = Embed(32768, 1024, positions=length, name="shared_embedding")
    x = embed(source)
    for block in range(6):
        x = Attention(16, 1024, name=f"encoder{block}_attention")(x)
        x = FeedForward(4096, 1024, "relu", name=f"encoder{block}_ffn")(x)
    y = embed(target)
    for block in range(6):
        y = Attention(16, 1024, causal=True, name=f"decoder{block}_self_attention")(y)
        y = Attention(16, 1024, name=f"decoder{block}_cross_attention")([y, x])
        y = FeedForward(4096, 1024, "relu", name=f"decoder{block}_ffn")(y)
    return keras.Model([source, target], SharedProjection(embed, name="output_projection")(y),
                       name="transformer_big")


MODELS = {"resnet50": resnet50, "transformer_big": transformer_big, "bert_base": bert_base, "vgg16": vgg16}


def _input_values(model, batch):
    import numpy as np
    rng = np.random.default_rng(0)
    values = []
    for spec in model.inputs:
        shape = (batch,) + tuple(spec.shape[1:])
        if "int" in str(spec.dtype):
            values.append(rng.integers(1, 1000, shape).astype("int32"))
        else:
            values.append(rng.random(shape, dtype="float32"))
    return values


def _median_seconds(function):
    function()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def profile(name, batch, progress=None):
    """{model, batch, device, layers: [{name, weights: [[shape]...], forward_s, backward_s}], ...}: the
    model's layers in forward order with their trainable weights and measured times. A weight shared
    by several layers belongs to the first that uses it (in backprop its gradient is complete when the
    last use, the first in forward order, is differentiated)."""
    import keras
    import tensorflow as tf
    model = MODELS[name]()
    inputs = _input_values(model, batch)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    # Every layer's input(s), from one forward pass.
    probes = keras.Model(model.inputs, [layer.input for layer in layers])
    values = probes(inputs if len(inputs) > 1 else inputs[0])
    seen, result = set(), []
    for layer, value in zip(layers, values):
        tensors = [tf.convert_to_tensor(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        weights = [w for w in layer.trainable_weights if id(w) not in seen]
        seen.update(id(w) for w in layer.trainable_weights)
        arguments = tensors if isinstance(value, (list, tuple)) else tensors[0]
        differentiable = [t for t in tensors if t.dtype.is_floating]

        def forward():
            return layer(arguments)

        def forward_backward():
            with tf.GradientTape() as tape:
                tape.watch(differentiable)
                output = layer(arguments)
            targets = differentiable + [w.value for w in layer.trainable_weights]
            return tape.gradient(output, targets, output_gradients=tf.ones_like(output)) if targets else None

        forward_s = _median_seconds(forward)
        both_s = _median_seconds(forward_backward)
        result.append({"name": layer.name, "weights": [list(w.shape) for w in weights],
                       "forward_s": forward_s, "backward_s": max(0.0, both_s - forward_s)})
        if progress:
            progress(f"{name}: {layer.name} forward {forward_s * 1e3:.2f} ms, backward {result[-1]['backward_s'] * 1e3:.2f} ms")
    parameters = sum(int(_prod(shape)) for layer in result for shape in layer["weights"])
    return {"model": name, "batch": batch, "inputs": [list(v.shape) for v in inputs], "parameters": parameters,
            "device": f"CPU: {_cpu_name()}, {os.cpu_count()} cores, TensorFlow {tf.__version__} eager, "
                      f"one process, per-layer timing",
            "layers": result}


def _prod(shape):
    total = 1
    for size in shape:
        total *= size
    return total


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
