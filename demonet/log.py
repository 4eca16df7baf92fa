"""Logging setup for demonet's entry points (the library only calls logging.getLogger(__name__))."""

import logging

__all__ = ["setup_logging"]


def setup_logging(level: int = logging.INFO) -> None:
    """One format for every demonet process: time, level, logger, then the "[peer_id round=N]" message."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # matplotlib (the run folder's plots) logs its first-run font cache at INFO: not a line of the run's.
    logging.getLogger("matplotlib").setLevel(max(level, logging.WARNING))
