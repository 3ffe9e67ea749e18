"""Where an observer of the runtime subscribes: the timeline's recorder, while it is on.

The runtime calls the observer at each collective and gradient bucket; with none subscribed (the
default) every such call is one test of `observer`. The observer's methods:
  now() -> a timestamp;
  run_collective(what, body) -> body(), timed as a collective the worker issues;
  caller_waited(what, since) after the calling thread waited for `what` from `since` on;
  handed_over(index) when a step hands over gradient bucket `index`;
  timed_buckets(reduce) -> `reduce` (one bucket -> its sum), wrapped to time each bucket.
"""

observer = None


def subscribe(new_observer):
    """Makes `new_observer` the runtime's observer (one at a time: the timeline)."""
    global observer
    observer = new_observer


def unsubscribe():
    global observer
    observer = None
