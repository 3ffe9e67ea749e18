"""keras-io's "Knowledge Distillation" on Keras' PyTorch backend: a teacher trained as usual, then
frozen, and a Distiller with its own compile(optimizer, metrics, student_loss_fn,
distillation_loss_fn, alpha, temperature) whose train_step (zero_grad, backward, optimizer.apply on
the student's weights, as keras-io's "Customizing what happens in fit() with PyTorch" writes it)
trains the student on the labels and the teacher's softened predictions, feeds the loss tracker and
the compiled metrics, and returns the student and distillation losses besides the metrics; its
test_step scores the student alone. fit with its default shuffle, evaluate, and predict with the
student (the Distiller's call). The networks are keras-io's, smaller; the images are made up (8x8),
labelled by the quadrant holding most of their weight, with an uneven last batch.
"""

import keras
import numpy as np
import torch
from keras import layers, ops

import tarantella as tnt

BACKENDS = ("torch",)

keras.utils.set_random_seed(1)


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer,
        metrics,
        student_loss_fn,
        distillation_loss_fn,
        alpha=0.1,
        temperature=3,
    ):
        """Configure the distiller.

        Args:
            optimizer: Keras optimizer for the student weights
            metrics: Keras metrics for evaluation
            student_loss_fn: Loss function of difference between student
                predictions and ground-truth
            distillation_loss_fn: Loss function of difference between soft
                student predictions and soft teacher predictions
            alpha: weight to student_loss_fn and 1-alpha to distillation_loss_fn
            temperature: Temperature for softening probability distributions.
                Larger temperature gives softer distributions.
        """
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def update_metrics(self, loss, y, y_pred):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def train_step(self, data):
        # Unpack data
        x, y = data

        # Forward pass of teacher
        teacher_predictions = self.teacher(x, training=False)

        # Forward pass of student
        self.zero_grad()
        student_predictions = self.student(x, training=True)

        # Compute losses
        student_loss = self.student_loss_fn(y, student_predictions)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_predictions / self.temperature, axis=1),
            ops.softmax(student_predictions / self.temperature, axis=1),
        )
        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        # Compute gradients
        loss.backward()
        trainable_vars = self.student.trainable_variables
        gradients = [v.value.grad for v in trainable_vars]

        # Update weights
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_vars)

        # Update the metrics configured in `compile()`, and return a dict of performance
        results = self.update_metrics(loss, y, student_predictions)
        results.update({"student_loss": student_loss, "distillation_loss": distillation_loss})
        return results

    def test_step(self, data):
        # Unpack the data
        x, y = data

        # Compute predictions
        y_prediction = self.student(x, training=False)

        # Calculate the loss
        student_loss = self.student_loss_fn(y, y_prediction)

        # Update the metrics, and return a dict of performance
        results = self.update_metrics(student_loss, y, y_prediction)
        results.update({"student_loss": student_loss})
        return results

    def call(self, x):
        return self.student(x)


# Create the teacher
teacher = keras.Sequential(
    [
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(4),
    ],
    name="teacher",
)

# Create the student
student = keras.Sequential(
    [
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(4),
    ],
    name="student",
)

# Made-up images, labelled by the quadrant that holds most of their weight.
rng = np.random.default_rng(7)
images = rng.random((600, 8, 8, 1)).astype("float32") ** 3
quadrants = images.reshape(600, 2, 4, 2, 4).sum(axis=(2, 4)).reshape(600, 4)
labels = quadrants.argmax(axis=1)
x_train, y_train, x_test, y_test = images[:470], labels[:470], images[470:], labels[470:]

# Train teacher as usual
teacher.compile(
    optimizer=keras.optimizers.Adam(),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
)
teacher.fit(x_train, y_train, epochs=2, verbose=0)
teacher.trainable = False

# Initialize and compile distiller
model = Distiller(student=student, teacher=teacher)
model = tnt.Model(model)
model.compile(
    optimizer=keras.optimizers.Adam(),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
    student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    distillation_loss_fn=keras.losses.KLDivergence(),
    alpha=0.1,
    temperature=10,
)

# Distill teacher to student
history = model.fit(x_train, y_train, epochs=2, verbose=0)

# Evaluate student on test dataset
score = model.evaluate(x_test, y_test, verbose=0)
predictions = ops.convert_to_numpy(ops.softmax(model.predict(x_test, verbose=0)))
