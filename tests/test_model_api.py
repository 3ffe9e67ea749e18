"""tnt.Model is a keras.Model that behaves like the model it wraps (one process)."""

import json

import keras
import numpy as np
import pytest

import tarantella as tnt


def functional():
    inputs = keras.Input((5,), name="features")
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden), name="net")


def test_rank_functions_in_a_single_process():
    assert (tnt.get_rank(), tnt.get_size(), tnt.get_master_rank(), tnt.is_master_rank()) == (0, 1, 0, True)
    assert tnt.init() is tnt.init()


def test_wrapper_is_a_keras_model_that_exposes_the_wrapped_one():
    plain = functional()
    model = tnt.Model(plain, parallel_strategy=tnt.ParallelStrategy.DATA)
    assert isinstance(model, keras.Model)
    assert model.name == "net"
    assert [layer.name for layer in model.layers] == ["features", "hidden", "head"]
    assert model.get_layer("head") is plain.get_layer("head")
    assert json.loads(model.to_json()) == json.loads(plain.to_json())
    assert model.inputs == plain.inputs and model.output is plain.output
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), plain.get_weights()))
    x = np.ones((4, 5), np.float32)
    np.testing.assert_array_equal(model(x), plain(x))
    model.set_weights([np.zeros_like(w) for w in plain.get_weights()])
    assert not np.any(plain(x))


def test_the_model_property_is_the_wrapped_keras_model():
    plain = functional()
    assert tnt.Model(plain).model is plain


def test_sequential_is_a_tnt_model_around_keras_sequential():
    model = tnt.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="hidden")], name="stack")
    model.add(keras.layers.Dense(2, name="head"))  # keras.Sequential's own methods answer
    assert isinstance(model, tnt.Model) and type(model.model) is keras.Sequential
    assert model.name == "stack" and [layer.name for layer in model.layers] == ["hidden", "head"]
    copy = tnt.Sequential.from_config(model.get_config())
    assert isinstance(copy, tnt.Sequential) and type(copy.model) is keras.Sequential
    assert [w.shape for w in copy.get_weights()] == [w.shape for w in model.get_weights()]
    with pytest.raises(ValueError, match="tnt.Model.from_config"):
        tnt.Sequential.from_config(functional().get_config())


def test_summary_prints_the_wrapped_models_layers(capsys):
    tnt.Model(functional()).summary()
    assert "hidden (Dense)" in capsys.readouterr().out


def test_wrong_inputs_to_the_wrapper_are_refused():
    with pytest.raises(TypeError, match="wraps a keras.Model"):
        tnt.Model(keras.layers.Dense(2))
    with pytest.raises(TypeError, match="already a tnt.Model"):
        tnt.Model(tnt.Model(functional()))
    with pytest.raises(ValueError, match="ParallelStrategy.DATA"):
        tnt.Model(functional(), parallel_strategy="pipeline")


def test_load_weights_before_compile_loads_the_saved_values_as_keras_does(tmp_path):
    saved = functional()
    saved.save_weights(tmp_path / "saved.weights.h5")
    model = tnt.Model(functional())
    model.load_weights(tmp_path / "saved.weights.h5")
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), saved.get_weights()))


def test_optimizer_names_and_configs_compile():
    for optimizer in ["adam", {"class_name": "SGD", "config": {"learning_rate": 0.1}}, keras.optimizers.Nadam()]:
        model = tnt.Model(functional())
        model.compile(optimizer, "mse")
        assert isinstance(model.optimizer, keras.optimizers.Optimizer)


# What tnt.Model answers itself (docs/guide.md, "What tnt.Model answers itself"): the methods that
# distribute work or write files, Keras' loop machinery, and state Keras' loop writes on the
# model it runs. Everything else a user reads must answer as the wrapped model does.
WRAPPER_OWN = {
    "fit", "evaluate", "predict", "compile", "train_step", "test_step", "predict_step",
    "train_on_batch", "test_on_batch", "predict_on_batch", "save", "save_weights", "load_weights",
    "set_weights", "summary", "from_config", "get_config", "call", "build", "reset_metrics",
    "make_train_function", "make_test_function", "make_predict_function", "train_function",
    "test_function", "predict_function", "stop_training", "history", "compiled", "jit_compile",
    "run_eagerly", "steps_per_execution", "stateless_call", "symbolic_call", "built", "distribute_strategy",
    "distribute_reduction_method", "export", "get_state_tree", "set_state_tree", "name", "path",
    "trainable", "add_loss", "add_metric", "add_weight", "add_variable", "build_from_config",
    "compile_from_config", "to_json",
}


def test_every_public_attribute_answers_as_the_wrapped_model_does():
    plain = functional()
    plain.compile("adam", "mse", metrics=["mae"])
    model = tnt.Model(plain)
    model.compile("adam", "mse", metrics=["mae"])
    x = np.ones((4, 5), np.float32)
    model.fit(x, np.zeros((4, 2), np.float32), verbose=0)
    assert model.get_config() == plain.get_config()
    differing = []
    for name in dir(plain):
        if name.startswith("_") or name in WRAPPER_OWN:
            continue
        theirs, ours = getattr(plain, name), getattr(model, name)
        if callable(theirs):
            same = getattr(ours, "__self__", None) is plain and ours.__func__ is theirs.__func__ \
                if hasattr(theirs, "__func__") else ours is theirs
        else:
            # Some properties build a new object on each read (input_spec): compare what they say.
            # Some properties build a new object on each read (input_spec, compiled_metrics): compare
            # what they say, or the kind of object they are.
            same = ours is theirs or (type(ours) is type(theirs) and (ours == theirs or repr(ours) == repr(theirs)))
            same = same or "<locals>" in type(ours).__qualname__ and \
                type(ours).__qualname__ == type(theirs).__qualname__
        if not same:
            differing.append(name)
    assert not differing, f"tnt.Model answers these differently from the wrapped model: {differing}"
    assert model.compute_output_shape((None, 5)) == plain.compute_output_shape((None, 5))
    assert repr(model.input_spec) == repr(plain.input_spec)


def synchronized_flags(config):
    """{layer name: synchronized} of the BatchNormalization layers in a functional model's config."""
    return {layer["config"]["name"]: layer["config"]["synchronized"] for layer in config["layers"]
            if layer["class_name"] == "BatchNormalization"}


def test_saves_and_configs_hold_batch_normalization_as_the_user_built_it(tmp_path, monkeypatch):
    """On 2 or more ranks, synchronized_batch_normalization=True switches the layers
    (batch_normalization.synchronize, called here on one rank). What is saved is the user's model: a
    layer tarantella switched unsynchronized, one the user built with synchronized=True (Keras on
    TensorFlow takes it) as it is, and on JAX and torch, whose Keras refuses synchronized=True, every
    layer unsynchronized. The layers stay synchronized for training."""
    from tarantella.model import batch_normalization

    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization(name="switched")(inputs)
    plain = keras.Model(inputs, keras.layers.BatchNormalization(synchronized=True, name="users")(hidden))
    batch_normalization.synchronize(plain)
    model = tnt.Model(plain)
    users_model = {"switched": False, "users": True}
    assert synchronized_flags(model.get_config()) == users_model
    assert synchronized_flags(json.loads(model.to_json())["config"]) == users_model
    model.save(tmp_path / "model.keras")
    tnt.models.save_model(plain, tmp_path / "plain.keras")
    for saved in ("model.keras", "plain.keras"):
        assert synchronized_flags(keras.models.load_model(tmp_path / saved).get_config()) == users_model, saved
    assert {layer.name: layer.synchronized for layer in tnt.models.clone_model(model).layers[1:]} == users_model
    assert [layer.synchronized for layer in plain.layers[1:]] == [True, True]
    # As on JAX and torch, whose Keras refuses synchronized=True.
    from tarantella.backends.tensorflow.step import TensorFlowStep
    monkeypatch.setattr(TensorFlowStep, "keras_accepts_synchronized_batch_normalization", False)
    assert synchronized_flags(model.get_config()) == {"switched": False, "users": False}
    assert [layer.synchronized for layer in plain.layers[1:]] == [True, True]
