import pytest

from conftest import WORKERS, assert_ok, launch


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_bucket_allreduce_and_row_gather_match_numpy_on_three_ranks(algorithm):
    process = launch(3, WORKERS / "collectives.py", options=["-x", f"TNT_ALLREDUCE={algorithm}"], timeout=300)
    assert_ok(process)
    assert all(f"rank {rank}: collectives agree" in process.stdout for rank in range(3))
