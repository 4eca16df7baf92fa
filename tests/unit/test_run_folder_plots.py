"""The run folder's plots and the log lines around them: what `demonet up` and `demonet train` leave behind."""

from __future__ import annotations

import logging

from demonet.loop import MetricsRow, runfolder


def _rows(num_rounds: int, peers: tuple[str, ...]) -> list[MetricsRow]:
    return [MetricsRow.from_dict({"round": r, "peer": p, "loss": 5.0 - 0.1 * r, "bytes_up": 100, "bytes_down": 120,
                                  "param_digest": f"d{r}", "round_time_s": 0.1, "compute_s": 0.1, "wait_s": 0.0,
                                  "contributors": len(peers), "aborted": False, "overlap": 0})
            for r in range(num_rounds) for p in peers]


def test_the_plots_say_what_they_show() -> None:
    # loss.png had no title, and compute_wait.png's only title was a small "overlap = 0".
    rows = _rows(5, ("a", "b"))
    loss, pipeline = runfolder.loss_figure(rows), runfolder.pipeline_figure(rows)
    try:
        assert loss.axes[0].get_title() == "Training loss by round: 2 peers, 5 rounds"
        title = pipeline.axes[0].get_title()
        assert title == "Time per round: compute and wait for the network (overlap = 0)"
        assert pipeline.axes[0].title.get_fontsize() >= loss.axes[0].title.get_fontsize()
    finally:
        import matplotlib.pyplot as plt

        plt.close(loss)
        plt.close(pipeline)


def test_logging_leaves_out_matplotlibs_font_cache_line() -> None:
    # The first run printed `INFO matplotlib.font_manager: generated new fontManager` among the run's lines.
    from demonet.log import setup_logging

    setup_logging()
    assert not logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.INFO)
    assert logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.WARNING)
