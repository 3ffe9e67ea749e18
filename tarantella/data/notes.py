"""Information lines about how a pipeline is split, each said once per process."""

import logging

logger = logging.getLogger("tarantella")
_said = set()


def info_once(message, *args):
    """Logs `message % args` at INFO, unless this process said it already."""
    text = message % args
    if text not in _said:
        _said.add(text)
        logger.info(text)
