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


def test_optimizer_names_and_configs_compile():
    for optimizer in ["adam", {"class_name": "SGD", "config": {"learning_rate": 0.1}}, keras.optimizers.Nadam()]:
        model = tnt.Model(functional())
        model.compile(optimizer, "mse")
        assert isinstance(model.optimizer, keras.optimizers.Optimizer)
