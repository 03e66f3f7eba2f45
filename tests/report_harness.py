"""Checks of a `moray bench ... --report DIR` directory, shared by every bench's tests."""

from __future__ import annotations

import json
import struct
from html.parser import HTMLParser
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        elif tag == "a":
            self.links.append(attrs["href"])


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG that decodes (PIL when installed; else its signature and IHDR chunk)."""
    try:
        from PIL import Image
    except ImportError:
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
        return struct.unpack(">II", data[16:24])
    with Image.open(path) as image:
        image.verify()  # checks the chunks' CRCs
    with Image.open(path) as image:
        image.load()  # decodes the pixels
        return image.size


def check_report(out_dir: Path, min_plots: int = 1) -> dict[str, Path]:
    """The report in `out_dir` is whole: index.html shows every PNG there by relative path, every file it
    references exists, every PNG decodes to a real picture, result.json parses. Returns {name: path} of
    the plots."""
    out_dir = Path(out_dir)
    page = _Links()
    page.feed((out_dir / "index.html").read_text())
    assert len(page.images) >= min_plots, page.images
    for ref in page.images + page.links:
        assert ref == Path(ref).name, f"{ref}: not a relative path inside the report"
        assert (out_dir / ref).is_file(), ref
    assert sorted(page.images) == sorted(p.name for p in out_dir.glob("*.png"))
    assert {"index.html", "result.json", *page.images} <= set(page.links)  # the file list
    for name in page.images:
        width, height = png_size(out_dir / name)
        assert width > 200 and height > 200, (name, width, height)
    json.loads((out_dir / "result.json").read_text())
    return {name: out_dir / name for name in page.images}
