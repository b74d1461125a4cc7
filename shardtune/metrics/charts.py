"""The PNG files of ``shardtune plot`` and ``shardtune expert-usage``: each written whole, and marked as a chart
shardtune drew.

A chart is drawn under a temporary name and renamed (``shardtune.atomic``), so a reader or a kill never meets half
of one. Its PNG ``Software`` text says shardtune drew it: drawing the charts again replaces the earlier ones (they
are derived from the logs), while a file of the same name that shardtune did not draw (a user's own ``loss.png``)
is replaced only with ``--overwrite``. Where charts may go at all is ``shardtune.run_dir.check_output_place``'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.atomic import staged_file
from shardtune.errors import InputError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CHART_SOFTWARE = "shardtune"


def drawn_by_shardtune(path: Path) -> bool:
    """Whether ``path`` is a PNG whose ``Software`` text is shardtune's."""
    from PIL import Image  # matplotlib's own dependency: there wherever a chart was drawn

    try:
        with Image.open(path) as image:
            return getattr(image, "text", {}).get("Software") == CHART_SOFTWARE
    except OSError:  # not an image, a directory, unreadable
        return False


def write_charts(figures: dict[Path, Figure], out: Path, overwrite: bool) -> None:
    """Each matplotlib figure into its PNG file (the keys), then closed. Where a file is already at one of the paths
    and shardtune did not draw it, nothing is written unless ``overwrite``: one line names it, and ``out`` (the
    command's ``--out``: the directory of the files, or the one file)."""
    import matplotlib.pyplot as plt

    try:
        others = [path for path in figures if os.path.lexists(path) and not drawn_by_shardtune(path)]
        if others and not overwrite:
            what = (
                f"already holds {', '.join(path.name for path in others)}, which shardtune did not draw"
                if out.is_dir()
                else "already exists and shardtune did not draw it"
            )
            them = "it" if len(others) == 1 else "them"
            raise InputError(f"--out {out}: {what}; choose another path, or pass --overwrite to replace {them}")
        for path, figure in figures.items():
            with staged_file(path) as staging:
                figure.savefig(staging, format="png", dpi=100, metadata={"Software": CHART_SOFTWARE})
    finally:
        for figure in figures.values():
            plt.close(figure)
