"""Plots as the project keeps them: PNGs with an adaptive palette.

A plot has a few dozen colours, and a palette of 256 keeps each as it was drawn (antialiased edges
merge into their nearest shade, invisibly at the resolutions saved here) at a third of the bytes of
matplotlib's RGBA file.
"""

from __future__ import annotations

import io
from pathlib import Path


def save_png(fig, path: str | Path, dpi: int = 110, colors: int = 256) -> Path:
    """Write the matplotlib figure ``fig`` to ``path`` as a palette PNG of at most ``colors`` colours.

    :return: the path written.
    """
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    out = Path(path)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=colors).save(out, format="PNG", optimize=True)
    return out
