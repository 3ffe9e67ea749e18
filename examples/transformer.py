"""The manual's Transformer tutorial on a small synthetic translation task.

Serial:    python examples/transformer.py
Two ranks: tarantella -n 2 -- examples/transformer.py

The task: "translate" a sequence of tokens into the same tokens in reverse order. Sequences
have different lengths and are padded with 0, so padding masks and the causal mask matter.

As in the tutorial:
- the data is distributed by hand: each rank batches the sentences into micro-batches of
  `global batch / ranks` and keeps every p-th micro-batch (`shard(tnt.get_size(),
  tnt.get_rank())`), so that the ranks' micro-batches of one step make up one global batch.
  `fit` gets `tnt_distribute_dataset=False`;
- the learning rate follows Vaswani et al.'s warm-up schedule,
  d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5);
- the training model is a `tnt.Model`; a serial Keras model built from the same layers
  translates (greedy decoding) on the master only, between rounds of training, with
  `initial_epoch`/`epochs` continuing the training where the last round stopped.
The loss is averaged over the tokens that are not padding, over the whole global batch, so
the History is the serial one on any number of ranks.
"""

import argparse
import json
import pathlib

import numpy as np

import tarantella as tnt  # sets the TensorFlow backend before Keras loads
import keras
import tensorflow as tf

PAD, START, END = 0, 1, 2
FIRST_WORD = 3  # tokens FIRST_WORD ... vocabulary-1 are words


@keras.saving.register_keras_serializable(package="tarantella_examples")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), with step counted from 1."""

    def __init__(self, d_model, warmup_steps):
        self.d_model = d_model
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32) + 1.0
        return self.d_model ** -0.5 * tf.minimum(step ** -0.5, step * self.warmup_steps ** -1.5)

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps}


def synthetic_pairs(samples, vocabulary, max_words, seed):
    """(source, target) pairs: target = the source's words reversed, then END; both padded
    with PAD to max_words + 1 tokens."""
    rng = np.random.default_rng(seed)
    source = np.full((samples, max_words + 1), PAD, np.int32)
    target = np.full((samples, max_words + 1), PAD, np.int32)
    for row, length in enumerate(rng.integers(2, max_words + 1, size=samples)):
        words = rng.integers(FIRST_WORD, vocabulary, size=length)
        source[row, :length] = words
        target[row, :length] = words[::-1]
        target[row, length] = END
    return source, target


def training_examples(source, target):
    """The decoder reads the target shifted right behind START and predicts the next token."""
    decoder_input = np.concatenate([np.full((len(target), 1), START, np.int32), target[:, :-1]], axis=1)
    decoder_input[target == PAD] = PAD  # nothing to read where nothing is predicted
    return {"source": source, "decoder_input": decoder_input}, target


class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocabulary, length, width, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, width)
        self.positions = keras.layers.Embedding(length, width)

    def call(self, tokens):
        positions = keras.ops.arange(keras.ops.shape(tokens)[-1])
        return self.tokens(tokens) + self.positions(positions)


class NextTokenLogits(keras.layers.Layer):
    """Logits over the vocabulary, masked where the decoder input is PAD: the compiled loss
    and metrics then average over the real target tokens only."""

    def __init__(self, vocabulary, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(vocabulary)
        self.supports_masking = True  # Keras attaches compute_mask's result to the output

    def call(self, inputs):
        features, decoder_input = inputs
        return self.dense(features)

    def compute_mask(self, inputs, mask=None):
        return keras.ops.not_equal(inputs[1], PAD)


def attention_block(query, context, attention_mask, heads, width, causal):
    attention = keras.layers.MultiHeadAttention(heads, width // heads)
    attended = attention(query, context, attention_mask=attention_mask, use_causal_mask=causal)
    return keras.layers.LayerNormalization()(query + attended)


def feed_forward_block(x, width, hidden):
    y = keras.layers.Dense(hidden, activation="relu")(x)
    y = keras.layers.Dense(width)(y)
    return keras.layers.LayerNormalization()(x + y)


def transformer(vocabulary, length, width, heads, hidden, layers):
    """An encoder-decoder Transformer: its inputs and its next-token logits. Attention never
    looks at PAD tokens, and the decoder's self-attention only at earlier positions."""
    source = keras.Input((length,), dtype="int32", name="source")
    decoder_input = keras.Input((length,), dtype="int32", name="decoder_input")
    source_keys = keras.ops.expand_dims(keras.ops.not_equal(source, PAD), 1)  # (batch, 1, length)
    target_keys = keras.ops.expand_dims(keras.ops.not_equal(decoder_input, PAD), 1)
    encoded = TokenAndPositionEmbedding(vocabulary, length, width, name="source_embedding")(source)
    for _ in range(layers):
        encoded = attention_block(encoded, encoded, source_keys, heads, width, causal=False)
        encoded = feed_forward_block(encoded, width, hidden)
    decoded = TokenAndPositionEmbedding(vocabulary, length, width, name="target_embedding")(decoder_input)
    for _ in range(layers):
        decoded = attention_block(decoded, decoded, target_keys, heads, width, causal=True)
        decoded = attention_block(decoded, encoded, source_keys, heads, width, causal=False)
        decoded = feed_forward_block(decoded, width, hidden)
    logits = NextTokenLogits(vocabulary, name="logits")([decoded, decoder_input])
    return {"source": source, "decoder_input": decoder_input}, logits


def rank_dataset(inputs, targets, global_batch, seed):
    """This rank's micro-batches, in the tutorial's manner: the ranks' micro-batches of one
    step are consecutive slices that together form one global batch."""
    ranks, rank = tnt.get_size(), tnt.get_rank()
    if global_batch % ranks:
        raise SystemExit(f"--batch-size {global_batch} must be a multiple of the number of ranks ({ranks}).")
    usable = len(targets) // global_batch * global_batch  # every rank must run the same number of steps
    dataset = tf.data.Dataset.from_tensor_slices((inputs, targets)).shuffle(len(targets), seed=seed)
    dataset = dataset.take(usable).batch(global_batch // ranks, drop_remainder=True)
    return dataset.shard(ranks, rank)


def translate(model, source, length):
    """Greedy decoding with a serial Keras model: one token per call, until END or length."""
    decoder_input = np.zeros_like(source)
    decoder_input[:, 0] = START
    output = np.zeros_like(source)
    for position in range(length):
        logits = model({"source": source, "decoder_input": decoder_input}, training=False)
        output[:, position] = np.argmax(keras.ops.convert_to_numpy(logits)[:, position], axis=-1)
        if position + 1 < length:
            decoder_input[:, position + 1] = output[:, position]
    return output


def exact_translations(predicted, target):
    """The share of sentences translated exactly, up to and including END."""
    mask = target != PAD
    return float(np.mean(np.all((predicted == target) | ~mask, axis=1)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048, help="training sentence pairs")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, in sentences")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--epochs-between-evals", type=int, default=4)
    parser.add_argument("--vocabulary", type=int, default=16, help="tokens, PAD, START and END included")
    parser.add_argument("--max-words", type=int, default=8)
    parser.add_argument("--width", type=int, default=32, help="d_model")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="the feed-forward layers' width")
    parser.add_argument("--layers", type=int, default=1, help="encoder and decoder layers each")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--test-samples", type=int, default=64, help="sentences translated on the master")
    parser.add_argument("--history-json", help="the master writes the History and the translation score here")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(args.seed)
    length = args.max_words + 1
    inputs, targets = training_examples(*synthetic_pairs(args.samples, args.vocabulary, args.max_words, args.seed))
    train = rank_dataset(inputs, targets, args.batch_size, args.seed)
    test_source, test_target = synthetic_pairs(args.test_samples, args.vocabulary, args.max_words, args.seed + 1)

    inputs, logits = transformer(args.vocabulary, length, args.width, args.heads, args.hidden, args.layers)
    trainer = tnt.Model(keras.Model(inputs, logits, name="transformer"))
    # A second, serial model over the same layers: it holds the trained weights on every rank.
    translator = keras.Model(inputs, logits, name="translator")
    trainer.compile(optimizer=keras.optimizers.Adam(TransformerSchedule(args.width, args.warmup_steps),
                                                    beta_1=0.9, beta_2=0.98, epsilon=1e-9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[keras.metrics.SparseCategoricalAccuracy()])

    history, scores, predicted = {}, [], None
    for first_epoch in range(0, args.epochs, args.epochs_between_evals):
        last_epoch = min(first_epoch + args.epochs_between_evals, args.epochs)
        round_history = trainer.fit(train, tnt_distribute_dataset=False, initial_epoch=first_epoch,
                                    epochs=last_epoch, verbose=2)
        for key, values in round_history.history.items():
            history.setdefault(key, []).extend(values)
        if tnt.is_master_rank():  # the other ranks go on; the next fit waits for the master
            predicted = translate(translator, test_source, length)
            scores.append(exact_translations(predicted, test_target))
            print(f"after epoch {last_epoch}: {scores[-1]:.1%} of {len(test_source)} test sentences translated "
                  f"exactly; e.g. {test_source[0].tolist()} -> {predicted[0].tolist()}", flush=True)

    if tnt.is_master_rank() and args.history_json:
        pathlib.Path(args.history_json).write_text(json.dumps(
            {"ranks": tnt.get_size(), "history": history, "exact_translations": scores,
             "last_translations": predicted.tolist()}, indent=1))


if __name__ == "__main__":
    main()
