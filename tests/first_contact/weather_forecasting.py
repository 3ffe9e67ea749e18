"""keras-io's "Timeseries forecasting for weather prediction", as its author wrote it: the 14
features of the Jena climate record, 7 of them selected and normalized with the training part's
mean and standard deviation, the temperature 72 steps (12 hours) ahead predicted from the past 720
steps sampled every 6 (`keras.utils.timeseries_dataset_from_array`, whose windows are specced
(None, None, 7)), an LSTM(32) and a Dense(1) trained with Adam(0.001) on mse in batches of 256,
EarlyStopping and ModelCheckpoint(save_weights_only=True, save_best_only=True) on val_loss, and a
prediction for each of 5 validation batches.

Two things differ, for a test without network or plotting: the record is made up (a day's and a
year's cycle, weather-like noise, one row every 10 minutes; 6000 rows instead of 420551) and held
in NumPy arrays instead of pandas DataFrames, and the plots are left out. 2 epochs instead of 10,
the checkpoint goes to a temporary directory, and the script also evaluates on the validation data.
"""

import os
import tempfile

import numpy as np
import keras

import tarantella as tnt

keras.utils.set_random_seed(42)

titles = [
    "Pressure",
    "Temperature",
    "Temperature in Kelvin",
    "Temperature (dew point)",
    "Relative Humidity",
    "Saturation vapor pressure",
    "Vapor pressure",
    "Vapor pressure deficit",
    "Specific humidity",
    "Water vapor concentration",
    "Airtight",
    "Wind speed",
    "Maximum wind speed",
    "Wind direction in degrees",
]


def jena_like_record(rows, rng):
    """The 14 columns of the Jena climate record, made up: a row every 10 minutes."""
    hours = np.arange(rows) / 6
    temperature = (9 + 8 * np.sin(2 * np.pi * (hours / 24 - 0.3)) + 10 * np.sin(2 * np.pi * (hours / 8766 - 0.2))
                   + np.cumsum(rng.normal(0, 0.05, rows)))
    pressure = 989 + np.cumsum(rng.normal(0, 0.1, rows)) - 0.2 * (temperature - 9)
    humidity = np.clip(76 - 2.5 * (temperature - 9) + rng.normal(0, 3, rows), 10, 100)
    saturation = 6.1078 * np.exp(17.27 * temperature / (temperature + 237.3))
    vapor = saturation * humidity / 100
    dew_point = 237.3 * np.log(vapor / 6.1078) / (17.27 - np.log(vapor / 6.1078))
    specific = 622 * vapor / (pressure - 0.378 * vapor)
    wind = np.abs(2 + np.cumsum(rng.normal(0, 0.1, rows)) % 4)
    return np.stack([
        pressure, temperature, temperature + 273.15 + 0.0065 * (1000 - pressure), dew_point, humidity,
        saturation, vapor, saturation - vapor, specific, 1000 * vapor / pressure,
        pressure * 100 / (287.05 * (temperature + 273.15)) * 1000 / 100, wind, wind * 1.6 + rng.uniform(0, 1, rows),
        rng.uniform(0, 360, rows),
    ], axis=1)


features_all = jena_like_record(6000, np.random.default_rng(42))

split_fraction = 0.715
train_split = int(split_fraction * int(features_all.shape[0]))
step = 6

past = 720
future = 72
learning_rate = 0.001
batch_size = 256
epochs = 2


def normalize(data, train_split):
    data_mean = data[:train_split].mean(axis=0)
    data_std = data[:train_split].std(axis=0)
    return (data - data_mean) / data_std


print(
    "The selected parameters are:",
    ", ".join([titles[i] for i in [0, 1, 5, 7, 8, 10, 11]]),
)
features = features_all[:, [0, 1, 5, 7, 8, 10, 11]]

features = normalize(features, train_split)

train_data = features[0:train_split]
val_data = features[train_split:]

start = past + future
end = start + train_split

x_train = train_data[:, [i for i in range(7)]]
y_train = features[start:end][:, [1]]

sequence_length = int(past / step)

dataset_train = keras.utils.timeseries_dataset_from_array(
    x_train,
    y_train,
    sequence_length=sequence_length,
    sampling_rate=step,
    batch_size=batch_size,
)

x_end = len(val_data) - past - future

label_start = train_split + past + future

x_val = val_data[:x_end][:, [i for i in range(7)]]
y_val = features[label_start:][:, [1]]

dataset_val = keras.utils.timeseries_dataset_from_array(
    x_val,
    y_val,
    sequence_length=sequence_length,
    sampling_rate=step,
    batch_size=batch_size,
)


for batch in dataset_train.take(1):
    inputs, targets = batch

print("Input shape:", inputs.numpy().shape)
print("Target shape:", targets.numpy().shape)

inputs = keras.layers.Input(shape=(inputs.shape[1], inputs.shape[2]))
lstm_out = keras.layers.LSTM(32)(inputs)
outputs = keras.layers.Dense(1)(lstm_out)

model = keras.Model(inputs=inputs, outputs=outputs)
model = tnt.Model(model)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate), loss="mse")
model.summary()

with tempfile.TemporaryDirectory() as checkpoint_dir:
    path_checkpoint = os.path.join(checkpoint_dir, "model_checkpoint.weights.h5")
    es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)

    modelckpt_callback = keras.callbacks.ModelCheckpoint(
        monitor="val_loss",
        filepath=path_checkpoint,
        verbose=1,
        save_weights_only=True,
        save_best_only=True,
    )

    history = model.fit(
        dataset_train,
        epochs=epochs,
        validation_data=dataset_val,
        callbacks=[es_callback, modelckpt_callback],
    )

score = model.evaluate(dataset_val)
predictions = [model.predict(x)[0] for x, y in dataset_val.take(5)]
