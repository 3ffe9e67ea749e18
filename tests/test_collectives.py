import pytest

from conftest import WORKERS, assert_ok, launch


# by-node: large buckets summed within the node to its first rank, then broadcast (on one node the
# ring across nodes has that one rank; tests/test_multihost_netns.py runs it across hosts).
SETTINGS = {"ring": "TNT_ALLREDUCE=ring", "mpi": "TNT_ALLREDUCE=mpi", "by-node": "TNT_HIERARCHICAL_ALLREDUCE=on"}


@pytest.mark.parametrize("algorithm", list(SETTINGS))
def test_bucket_allreduce_and_row_gather_match_numpy_on_three_ranks(algorithm):
    process = launch(3, WORKERS / "collectives.py", options=["-x", SETTINGS[algorithm]], timeout=300)
    assert_ok(process)
    assert all(f"rank {rank}: collectives agree" in process.stdout for rank in range(3))


def test_large_buckets_go_node_by_node_by_themselves_only_where_several_nodes_hold_several_ranks():
    from tarantella.runtime.world import _by_node
    assert _by_node("auto", nodes=2, most_ranks_on_a_node=2)
    assert not _by_node("auto", nodes=1, most_ranks_on_a_node=4)  # nothing crosses a network
    assert not _by_node("auto", nodes=4, most_ranks_on_a_node=1)  # nothing to gather within a node
    assert _by_node("on", nodes=1, most_ranks_on_a_node=1)
    assert not _by_node("off", nodes=4, most_ranks_on_a_node=4)
