"""The MPI runtime of a rank: the world and its communicator, the worker thread that issues every
collective in one fixed order, the agreement before each, the gradient reducer, the peer monitor
that diagnoses stalls and lost ranks, and what ends the job when one rank fails.

It imports no machine-learning framework (numpy and mpi4py only) and nothing of tarantella above
`tarantella.common`; what watches it (the timeline) subscribes through `runtime.events`.
"""
