import numpy as np
import pytest

from tarantella.backends.fusion import plan_buckets

F32, F64 = "float32", "float64"


@pytest.mark.parametrize("threshold, expected", [
    (0, [[0], [1], [2], [3], [4]]),       # no fusion: one allreduce per tensor
    (100, [[0], [1], [2, 3, 4]]),          # 40+40+10 = 90 stays below 100: the short last bucket
    (150, [[0], [1, 2], [3, 4]]),          # 120+40 = 160 closes a bucket; 40+10 is the rest
    (10**9, [[0, 1, 2, 3, 4]]),            # everything in one bucket
])
def test_buckets_close_once_they_reach_the_threshold(threshold, expected):
    assert plan_buckets([400, 120, 40, 40, 10], [F32] * 5, threshold) == expected


def test_a_tensor_that_reaches_the_threshold_travels_alone():
    # The bias before the big kernel waits for the next small tensors instead of being copied with it.
    assert plan_buckets([10, 500, 10, 95, 7], [F32] * 5, 100) == [[1], [0, 2, 3], [4]]


def test_every_tensor_lands_in_exactly_one_bucket():
    sizes = [7, 300, 1, 1, 1, 90, 2000, 3]
    for threshold in (0, 5, 64, 100, 1000, 5000):
        buckets = plan_buckets(sizes, [F32] * len(sizes), threshold)
        assert sorted(i for bucket in buckets for i in bucket) == list(range(len(sizes)))
        assert all(bucket == sorted(bucket) for bucket in buckets)
        assert all(sum(sizes[i] for i in bucket) >= threshold for bucket in buckets[:-1])


def test_a_bucket_never_mixes_dtypes():
    buckets = plan_buckets([10, 10, 10, 10], [F32, F32, F64, F64], 1000)
    assert buckets == [[0, 1], [2, 3]]


def test_no_tensors_no_buckets():
    assert plan_buckets([], [], 32 * 1024) == []


def test_two_buckets_in_one_buffer_are_refused_not_summed_twice():
    # The allreduce writes each bucket in place: one buffer handed over as two buckets would
    # hold the sum of the sum. tarantella's graph keeps buckets apart; this is the last guard.
    from tarantella.runtime.errors import CollectiveError
    from tarantella.runtime.reducer import BucketRound

    gradient = np.arange(6, dtype=np.float32)
    step = BucketRound(3)
    step.deposit(0, gradient)
    step.deposit(1, gradient.copy())  # equal values in a buffer of its own are fine
    with pytest.raises(CollectiveError, match="gradient buckets 0 and 2 of this step are one buffer"):
        step.deposit(2, gradient[:])
    assert step.arrays[2] is None
