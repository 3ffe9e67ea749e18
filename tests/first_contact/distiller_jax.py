"""keras-io's "Knowledge Distillation" on Keras' JAX backend: a teacher trained as usual, then frozen,
and a Distiller with its own compile(optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha,
temperature) whose stateless train_step(state, data), as keras-io's "Customizing what happens in
fit() with JAX" writes one, runs the teacher in a StatelessScope over the non-trainable state (the
frozen teacher's weights), differentiates the student's loss (stateless_call, jax.value_and_grad),
updates with optimizer.stateless_apply, feeds the loss tracker and the compiled metrics statelessly
and returns the student and distillation losses besides the metrics; its test_step scores the
student alone. fit with its default shuffle, evaluate, and predict with the student (the
Distiller's call). The networks are keras-io's, smaller; the images are made up (8x8), labelled by
the quadrant holding most of their weight, with an uneven last batch.
"""

import jax
import keras
import numpy as np
from keras import layers, ops

import tarantella as tnt

BACKENDS = ("jax",)

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

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, teacher_predictions, x, y):
        # Forward pass of student
        student_predictions, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x
        )
        # Compute losses
        student_loss = self.student_loss_fn(y, student_predictions)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_predictions / self.temperature, axis=1),
            ops.softmax(student_predictions / self.temperature, axis=1),
        )
        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss, (student_loss, distillation_loss, student_predictions, non_trainable_variables)

    def update_metrics(self, metrics_variables, loss, y, y_pred):
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_vars)
            this_metric_vars = metrics_variables[start : start + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return new_metrics_vars, logs

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        # Unpack data
        x, y = data

        # Forward pass of teacher, whose frozen weights are non-trainable state
        with keras.StatelessScope(state_mapping=list(zip(self.non_trainable_variables, non_trainable_variables))):
            teacher_predictions = self.teacher(x, training=False)

        # Compute gradients of the student's loss
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (student_loss, distillation_loss, student_predictions, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, teacher_predictions, x, y
        )

        # Update weights
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

        # Update the metrics configured in `compile()`, and return a dict of performance
        metrics_variables, results = self.update_metrics(metrics_variables, loss, y, student_predictions)
        results.update({"student_loss": student_loss, "distillation_loss": distillation_loss})
        return results, (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables)

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        # Unpack the data
        x, y = data

        # Compute predictions
        y_prediction, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x
        )

        # Calculate the loss
        student_loss = self.student_loss_fn(y, y_prediction)

        # Update the metrics, and return a dict of performance
        metrics_variables, results = self.update_metrics(metrics_variables, student_loss, y, y_prediction)
        results.update({"student_loss": student_loss})
        return results, (trainable_variables, non_trainable_variables, metrics_variables)

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
predictions = np.asarray(ops.softmax(model.predict(x_test, verbose=0)))
