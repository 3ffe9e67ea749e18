"""The cluster's warning signal on a rank: a request to save and stop, which rides in the ranks' next agreement.

With TNT_SAVE_ON_SIGNAL (the command's `--save-on-signal`), the signal only marks the communicator
(`stop_wanted`); the next agreement message sums the marks, so every rank learns in the same
message that some rank got the warning (`stop_agreed`), and `fit`'s automatic backups stop all of
them at the same step (tarantella/backups.py). The signal may come from the command, which passes it
to the ranks on its host, or straight from the batch system to every rank; both are one request.
A rank thereby ignores the signal's default action: with TERM, the command or the batch system
ends it with SIGKILL where it cannot stop in time.
"""

import logging
import signal

from tarantella.common import rank_entry

logger = logging.getLogger("tarantella")


def listen(communicator, signum):
    """Makes `signum` a request to save and stop on this rank (from the main thread only)."""
    def request(_received, _frame):
        communicator.stop_wanted = True  # no logging here: a handler may interrupt a logging call

    try:
        signal.signal(signum, request)
        if rank_entry.warning_received:  # it came while the program started, before tarantella listened
            communicator.stop_wanted = True
    except ValueError:  # tarantella was first imported outside the main thread
        logger.warning("tarantella could not listen for %s (it was first imported outside the main thread): "
                       "this rank will not save on it.", signal.Signals(signum).name)
