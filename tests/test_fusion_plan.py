import numpy as np
import pytest

from tarantella.backends.fusion import (BucketLayout, automatic_threshold_bytes, gradient_wire, plan_buckets,
                                       round_description)
from tarantella.common import config

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


def test_the_layout_places_each_gradient_at_its_offset_in_backprop_order():
    # Gradients 0..3 (elements) in backprop order 3, 2, 1, 0; a threshold of 40 bytes. 5 float64
    # and 20 float32 reach it alone; the 3 float64 wait, and close when a float32 follows them.
    layout = BucketLayout([4, 20, 3, 5], [F32, F32, F64, F64], 40, [3, 2, 1, 0])
    assert layout.buckets == [(F64, 5, [(3, 0, 5)]), (F32, 20, [(1, 0, 20)]), (F64, 3, [(2, 0, 3)]),
                              (F32, 4, [(0, 0, 4)])]
    fused = BucketLayout([4, 2, 3], [F32] * 3, 1000, [2, 1, 0])
    assert fused.buckets == [(F32, 9, [(2, 0, 3), (1, 3, 2), (0, 5, 4)])]
    assert fused.place == {2: (0, 0, 3), 1: (0, 3, 2), 0: (0, 5, 4)}
    assert round_description(fused.names() + ["sparse"], "float32") == \
        "a gradient allreduce of buckets float32[9], sparse"
    assert round_description(fused.names(), "bfloat16") == "a gradient allreduce of buckets float32[9], sent as bfloat16"


def test_the_automatic_threshold_stays_small_on_one_node_and_grows_with_the_ranks_and_the_link_across_nodes():
    KIB, MIB = 1 << 10, 1 << 20
    # One node: messages cost microseconds, and small buckets start summing early.
    assert {automatic_threshold_bytes(ranks, 1) for ranks in (1, 2, 8, 64)} == {32 * KIB}
    # Across nodes each bucket's 2 (p - 1) latencies stay 1/16 of its transfer: 16 p alpha beta,
    # rounded up to a power of two, between 32 KiB and 16 MiB. On 10 GbE (25 us, 1.25 GB/s) that
    # is 512 KiB per rank.
    ten_gbe = (25e-6, 1.25e9)
    across = [automatic_threshold_bytes(ranks, nodes, *ten_gbe) for ranks, nodes in
              ((2, 2), (4, 2), (8, 8), (16, 4), (32, 32), (1024, 64))]
    assert across == [1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 16 * MIB]
    # A link of twice the latency, or twice the rate, doubles it; a fast, short one keeps the floor.
    assert automatic_threshold_bytes(4, 4, 50e-6, 1.25e9) == automatic_threshold_bytes(4, 4, 25e-6, 2.5e9) == 4 * MIB
    assert automatic_threshold_bytes(2, 2, 1e-6, 1e8) == 32 * KIB
    # Not exactly a power of two: rounded up (16 * 3 * 25 us * 1.25 GB/s = 1.5 MB).
    assert automatic_threshold_bytes(3, 3, *ten_gbe) == 2 * MIB


def test_a_threshold_the_user_sets_replaces_the_automatic_one(monkeypatch):
    monkeypatch.delenv("TNT_FUSION_THRESHOLD", raising=False)
    assert config.fusion_threshold_bytes() is None
    for kilobytes, expected in (("0", 0), ("64", 65536), ("1.5", 1536)):
        monkeypatch.setenv("TNT_FUSION_THRESHOLD", kilobytes)
        assert config.fusion_threshold_bytes() == expected
    monkeypatch.setenv("TNT_FUSION_THRESHOLD", "big")
    with pytest.raises(ValueError, match="TNT_FUSION_THRESHOLD='big' is not a number of kilobytes; set it to a "
                                         "number >= 0[.]"):
        config.fusion_threshold_bytes()


def test_the_automatic_gradient_wire_is_16_bit_only_for_a_model_all_of_one_16_bit_type():
    assert gradient_wire("auto", ["float32", "float32"]) == "float32"
    assert gradient_wire("auto", ["bfloat16", "bfloat16"]) == "bfloat16"
    assert gradient_wire("auto", ["float16"]) == "float16"
    assert gradient_wire("auto", ["bfloat16", "float32"]) == "float32"  # a float32 layer keeps its exact sums
    assert gradient_wire("auto", ["bfloat16", "float16"]) == "float32"
    assert gradient_wire("auto", []) == "float32"
    assert gradient_wire("bfloat16", ["float32"]) == "bfloat16"
    assert gradient_wire("float32", ["float16"]) == "float32"
