"""Collective kinds (tarantella/runtime/kinds.py): a collective's words, its timeline name and its
category come from its kind, not from matching its words."""

from tarantella import timeline_report
from tarantella.runtime.kinds import Collective, kind_and_words


def test_every_kind_is_its_own_member():
    assert len({kind.value for kind in Collective}) == len(Collective) == len(Collective.__members__)


def test_a_kind_names_its_collectives_whatever_their_words():
    assert timeline_report.kind_of("BATCHNORM_MOMENTS", "any words at all") == ("sync BatchNorm moments", "batchnorm")
    assert timeline_report.kind_of("STEP_OPENING", "the opening of a step") == ("step opening", "opening")
    # Words that an earlier version matched by substring no longer decide anything.
    assert timeline_report.kind_of("OTHER", "the allreduce of losses and metrics")[1] == "other"


def test_public_collectives_are_named_by_their_call_and_others_by_their_words():
    assert timeline_report.kind_of("PUBLIC", "tnt.allreduce of float32[3]") == ("tnt.allreduce", "public")
    assert timeline_report.kind_of("OTHER", "the check whether m.keras exists") == ("the check whether m.keras exists", "other")


def test_a_caller_names_a_collective_by_its_kind_or_by_words_and_a_kind():
    assert kind_and_words(Collective.LOSS_DIVISOR) == (Collective.LOSS_DIVISOR, "the allreduce of a loss's divisor")
    assert kind_and_words("tnt.barrier", Collective.PUBLIC) == (Collective.PUBLIC, "tnt.barrier")
    assert kind_and_words("the broadcast of the master's weights") == (Collective.OTHER, "the broadcast of the master's weights")
