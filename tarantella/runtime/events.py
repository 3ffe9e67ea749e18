"""Where an observer of the rank subscribes: the timeline's recorder, while it is on.

The runtime, the steps and tnt.Model tell the observer what happens, through `observer` or the
functions below; with none subscribed (the default) each is one test of `observer`, and nothing
below the observer imports it. The observer's methods:
  now() -> a timestamp;
  run_collective(what, body) -> body(), timed as a collective the worker issues;
  caller_waited(what, since) after the calling thread waited for `what` from `since` on;
  handed_over(index) when a step hands over gradient bucket `index`;
  timed_buckets(reduce, wire_bytes) -> `reduce` (one bucket -> its sum), wrapped to time each
    bucket and record its `wire_bytes(bucket)`;
  input_arrived(timestamp_s) when a step's batch arrived (its tf.timestamp());
  timed_steps(function, kind) -> Keras' train or test `function`, wrapped to time each call;
  span(name) -> a context that times `name` on the main thread (a save, say);
  fit_ended(communicator) at the end of every fit, on every rank (a collective).
"""

import contextlib

observer = None


def subscribe(new_observer):
    """Makes `new_observer` the runtime's observer (one at a time: the timeline)."""
    global observer
    observer = new_observer


def unsubscribe():
    global observer
    observer = None


def span(name):
    """A context that the observer times as `name`; nothing without one."""
    return contextlib.nullcontext() if observer is None else observer.span(name)


def timed_steps(function, kind):
    """Keras' train or test `function`, timed per call by the observer where there is one."""
    return function if observer is None else observer.timed_steps(function, kind)


def fit_ended(communicator):
    """Tells the observer, on every rank, that a fit has ended."""
    if observer is not None:
        observer.fit_ended(communicator)
