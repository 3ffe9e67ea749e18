"""What a collective is for: one member per kind, from which its words in messages, its part in the
agreement code and its name and category in the timeline all derive, so that rewording a message
cannot break an agreement or a trace."""

import enum


class Collective(enum.Enum):
    """The kinds of collectives. `what`: the words messages use (None: the caller's own, such as
    "tnt.allreduce" or "the check whether a file exists"); `timeline_name`: its name in a trace
    (None: the caller's words, or for a public collective the call); `category`: its category there."""

    STEP_OPENING = ("the allreduce of micro-batch sizes", "step opening", "opening")
    LOSSES_AND_METRICS = ("the allreduce of losses and metrics", "losses and metrics", "metrics")
    LOSS_DIVISOR = ("the allreduce of a loss's divisor", "loss divisor", "metrics")
    BATCHNORM_MOMENTS = ("the allreduce of synchronized BatchNormalization moments", "sync BatchNorm moments",
                         "batchnorm")
    BATCHNORM_GRADIENTS = ("the allreduce of synchronized BatchNormalization gradients", "sync BatchNorm gradients",
                           "batchnorm")
    GRADIENTS = ("the gradient allreduce", "gradient buckets", "gradients")
    PREDICTIONS = ("the gathering of predictions", "gathering of predictions", "other")
    PUBLIC = (None, None, "public")
    TIMELINE = (None, "timeline gathering", "other")
    OTHER = (None, None, "other")

    def __new__(cls, what, timeline_name, category):
        member = object.__new__(cls)
        member._value_ = len(cls.__members__)  # distinct, so that no two kinds are one
        member.what = what
        member.timeline_name = timeline_name
        member.category = category
        return member

    def named(self, words):
        """The name of a collective of this kind, described by the caller as `words`, in a trace."""
        if self.timeline_name is not None:
            return self.timeline_name
        return words.split(" ")[0] if self is Collective.PUBLIC else words


def kind_and_words(what, kind=None):
    """(kind, words) of a collective that the caller describes by its kind (whose own words then
    name it), or by words of its own and an optional `kind` (default: OTHER)."""
    if isinstance(what, Collective):
        return what, what.what
    return kind or Collective.OTHER, what
