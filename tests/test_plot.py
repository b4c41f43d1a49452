"""The PNG line-plot writer: a valid PNG whose pixels show the curves."""

import struct
import zlib

import numpy as np

from needle.plot import PALETTE, save_line_plots, write_png


def read_png(path) -> np.ndarray:
    """Decode the PNGs write_png makes (8-bit RGB, filter 0) and check every chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, -1)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


def test_write_png_round_trip(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    write_png(tmp_path / "a.png", image)
    np.testing.assert_array_equal(read_png(tmp_path / "a.png"), image)


def test_curves_are_drawn(tmp_path):
    path = tmp_path / "curves.png"
    save_line_plots(path, {"loss": {"train": [2.0, 1.0, 0.5, float("nan"), 0.2]},
                           "accuracy": {"train": [0.1, 0.9], "test": [0.5]}})
    image = read_png(path)
    assert image.shape == (300, 840, 3)
    blue, orange = np.array(PALETTE[0]), np.array(PALETTE[1])
    left, right = image[:, :420], image[:, 420:]
    assert (left == blue).all(-1).sum() > 200  # a line, not just the legend swatch
    assert (right == orange).all(-1).sum() > 100  # legend swatch and the single point
    assert not (left == orange).all(-1).any()
