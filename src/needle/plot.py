"""Line plots written as PNG files with numpy and zlib only.

Training scripts want a picture of their loss and accuracy curves without pulling in
matplotlib, so this module draws the few things such a picture needs (axes, polylines, a
3x5 pixel font for titles, tick values and legends) into an RGB array and encodes it.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

Color = tuple[int, int, int]

PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
                              (148, 103, 189), (140, 86, 75))
_BLACK, _GREY, _WHITE = (0, 0, 0), (225, 225, 225), (255, 255, 255)

# 3x5 glyphs, rows top to bottom; lowercase text is drawn with these capitals.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    ":": "000010000010000", "/": "001001010100100", "_": "000000000000111",
    "(": "010100100100010", ")": "010001001001010", "e": "111100110100111",
    "a": "010101111101101", "b": "110101110101110", "c": "011100100100011",
    "d": "110101101101110", "f": "111100110100100", "g": "011100101101011",
    "h": "101101111101101", "i": "111010010010111", "j": "001001001101010",
    "k": "101101110101101", "l": "100100100100111", "m": "101111111101101",
    "n": "110101101101101", "o": "010101101101010", "p": "110101110100100",
    "q": "010101101110011", "r": "110101110101101", "s": "011100010001110",
    "t": "111010010010010", "u": "101101101101111", "v": "101101101101010",
    "w": "101101111111101", "x": "101101010101101", "y": "101101010010010",
    "z": "111001010100111", " ": "000000000000000",
}


def write_png(path: str | Path, image: np.ndarray) -> None:
    """Write an (height, width, 3) uint8 RGB array as a PNG file."""
    image = np.ascontiguousarray(image, dtype=np.uint8)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"write_png needs an (height, width, 3) array, got shape {image.shape}")
    height, width, _ = image.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, -1)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
           + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)


def draw_text(image: np.ndarray, x: int, y: int, text: str, color: Color = _BLACK,
              scale: int = 2) -> int:
    """Draw ``text`` with its top-left corner at (x, y); returns the x after the last glyph."""
    for ch in text.lower():
        bits = _FONT.get(ch, _FONT[" "])
        glyph = np.array([int(b) for b in bits], bool).reshape(5, 3)
        glyph = glyph.repeat(scale, 0).repeat(scale, 1)
        _paint(image, y, x, glyph, color)
        x += 4 * scale
    return x


def text_width(text: str, scale: int = 2) -> int:
    return 4 * scale * len(text) - scale if text else 0


def _paint(image: np.ndarray, y: int, x: int, mask: np.ndarray, color: Color) -> None:
    """Set the pixels of ``mask`` (placed at y, x) to ``color``, clipped to the image."""
    h, w = image.shape[:2]
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + mask.shape[0], h), min(x + mask.shape[1], w)
    if y0 < y1 and x0 < x1:
        region = image[y0:y1, x0:x1]
        region[mask[y0 - y:y1 - y, x0 - x:x1 - x]] = color


def draw_line(image: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: Color,
              width: int = 2) -> None:
    """A straight line ``width`` pixels thick, sampled once per pixel along its length."""
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    h, w = image.shape[:2]
    for dy in range(width):
        for dx in range(width):
            yy, xx = ys + dy - width // 2, xs + dx - width // 2
            ok = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
            image[yy[ok], xx[ok]] = color


def _fmt(v: float) -> str:
    if v == 0 or 0.01 <= abs(v) < 1e4:
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.4g}"
    return f"{v:.1e}"


def _draw_panel(image: np.ndarray, left: int, top: int, width: int, height: int, title: str,
                series: Mapping[str, Sequence[float]], xlabel: str) -> None:
    margin_l, margin_r, margin_t, margin_b = 56, 12, 28, 24
    px0, px1 = left + margin_l, left + width - margin_r
    py0, py1 = top + margin_t, top + height - margin_b
    draw_text(image, px0, top + 8, title)

    values = [np.asarray(v, np.float64) for v in series.values()]
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.zeros(0)
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.05
    lo = 0.0 if 0 <= lo < pad else lo - pad  # a non-negative series keeps its zero baseline
    hi += pad
    n_max = max((len(v) for v in values), default=1)

    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):  # gridlines with their values
        y = py1 - frac * (py1 - py0)
        draw_line(image, px0, y, px1, y, _GREY, width=1)
        label = _fmt(lo + frac * (hi - lo))
        draw_text(image, px0 - 6 - text_width(label), int(y) - 5, label)
    draw_line(image, px0, py0, px0, py1, _BLACK, width=1)
    draw_line(image, px0, py1, px1, py1, _BLACK, width=1)
    draw_text(image, px0, py1 + 6, "1")
    draw_text(image, px1 - text_width(str(n_max)), py1 + 6, str(n_max))
    draw_text(image, (px0 + px1 - text_width(xlabel)) // 2, py1 + 6, xlabel)

    def to_px(i: int, v: float) -> tuple[float, float]:
        x = px0 + (i / max(n_max - 1, 1)) * (px1 - px0)
        return x, py1 - (v - lo) / (hi - lo) * (py1 - py0)

    for k, v in enumerate(values):
        color = PALETTE[k % len(PALETTE)]
        points = [to_px(i, x) if math.isfinite(x) else None for i, x in enumerate(v)]
        for a, b in zip(points, points[1:]):
            if a is not None and b is not None:
                draw_line(image, *a, *b, color)
        if len(points) == 1 and points[0] is not None:
            draw_line(image, *points[0], *points[0], color, width=4)

    legend_x = px1  # legends are right-aligned on the title row, in series order
    for k, name in reversed(list(enumerate(series.keys()))):
        legend_x -= text_width(name) + 14
        _paint(image, top + 8, legend_x, np.ones((10, 10), bool), PALETTE[k % len(PALETTE)])
        draw_text(image, legend_x + 14, top + 8, name)
        legend_x -= 12


def save_line_plots(path: str | Path, panels: Mapping[str, Mapping[str, Sequence[float]]],
                    xlabel: str = "", panel_size: tuple[int, int] = (420, 300)) -> None:
    """Write one panel per entry of ``panels`` (title -> {series name: values}), side by side.

    The x axis of a panel runs over the positions of its values (1 .. n), so curves recorded
    once per epoch or once per step plot as they were recorded; ``xlabel`` names that unit.
    NaN and inf values leave gaps.
    """
    width, height = panel_size
    image = np.full((height, width * max(len(panels), 1), 3), _WHITE, np.uint8)
    for i, (title, series) in enumerate(panels.items()):
        _draw_panel(image, i * width, 0, width, height, title, series, xlabel)
    write_png(path, image)
