#!/usr/bin/env python3
"""Turns a train_moe --log file (JSON lines) into a loss-curve PNG.

    python3 scripts/plot_loss.py run.jsonl loss.png [other.jsonl]

Training loss per step in blue, validation loss in red (dots joined), on a linear axis
with labelled ticks; a second run given (fp8 against bf16, say) adds its training loss in
orange and its validation loss in green, labelled "vs". Plain Python (zlib + struct), so it runs wherever Python does; no
plotting library needed."""
import json
import math
import struct
import sys
import zlib

W, H = 800, 480
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 30, 50

# 3x5 bitmap font: each glyph is 5 rows of 3 bits (MSB left).
FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
    " ": (0, 0, 0, 0, 0), "a": (0, 7, 5, 7, 5), "e": (7, 4, 7, 4, 7), "i": (2, 0, 2, 2, 2),
    "l": (4, 4, 4, 4, 7), "n": (0, 6, 5, 5, 5), "o": (0, 7, 5, 5, 7), "p": (7, 5, 7, 4, 4),
    "r": (0, 7, 4, 4, 4), "s": (7, 4, 7, 1, 7), "t": (2, 7, 2, 2, 3), "v": (0, 5, 5, 5, 2),
    "d": (1, 1, 7, 5, 7), "/": (1, 1, 2, 4, 4), "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4),
    "b": (4, 4, 7, 5, 7), "y": (5, 5, 7, 1, 7), "k": (5, 5, 6, 5, 5), "x": (0, 5, 2, 5, 0),
    "m": (0, 7, 7, 5, 5), "c": (0, 7, 4, 4, 7), "u": (0, 5, 5, 5, 7), "h": (4, 4, 7, 5, 5),
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray([255] * (w * h * 3))

    def dot(self, x, y, rgb):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, width=1):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            x = round(x0 + (x1 - x0) * k / n)
            y = round(y0 + (y1 - y0) * k / n)
            for dx in range(width):
                for dy in range(width):
                    self.dot(x + dx, y + dy, rgb)

    def text(self, x, y, s, rgb=(0, 0, 0), scale=2):
        for ch in s:
            rows = FONT.get(ch.lower(), FONT[" "])
            for r, bits in enumerate(rows):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        for dx in range(scale):
                            for dy in range(scale):
                                self.dot(x + c * scale + dx, y + r * scale + dy, rgb)
            x += 4 * scale

    def png(self):
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))
        def chunk(tag, data):
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def nice_ticks(lo, hi, n=6):
    span = hi - lo if hi > lo else 1.0
    step = 10 ** math.floor(math.log10(span / n))
    for m in (1, 2, 5, 10):
        if span / (step * m) <= n:
            step *= m
            break
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-12:
        out.append(t)
        t += step
    return out, step


def fmt(v, step):
    digits = max(0, -int(math.floor(math.log10(step)))) if step < 1 else 0
    return "%.*f" % (digits, v)


def read_log(path):
    """(training points, validation points) of a --log file, or None after printing why not."""
    train, val = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                print("plot_loss: %s line %d: %s" % (path, n, e), file=sys.stderr)
                return None
            if r.get("type") == "step" and r.get("loss") is not None:
                train.append((r["step"], r["loss"]))
            elif r.get("type") == "val" and r.get("val_loss") is not None:
                val.append((r["step"], r["val_loss"]))
    if not train:
        print("plot_loss: %s has no step lines" % path, file=sys.stderr)
        return None
    return train, val


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = [read_log(p) for p in [argv[1]] + argv[3:4]]
    if None in runs:
        return 1
    train, val = runs[0]
    pts = [p for t, v in runs for p in t + v]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    pad = 0.05 * (y1 - y0 if y1 > y0 else 1.0)
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    sx = lambda x: LEFT + round((x - x0) / (x1 - x0) * pw)
    sy = lambda y: TOP + round((y1 - y) / (y1 - y0) * ph)
    c = Canvas(W, H)
    yt, ys = nice_ticks(y0, y1)
    for t in yt:
        c.line(LEFT, sy(t), W - RIGHT, sy(t), (225, 225, 225))
        c.text(4, sy(t) - 5, fmt(t, ys))
    xt, xs = nice_ticks(x0, x1)
    for t in xt:
        c.line(sx(t), TOP, sx(t), H - BOTTOM, (225, 225, 225))
        c.text(sx(t) - 8, H - BOTTOM + 8, fmt(t, xs))
    c.line(LEFT, TOP, LEFT, H - BOTTOM, (0, 0, 0))
    c.line(LEFT, H - BOTTOM, W - RIGHT, H - BOTTOM, (0, 0, 0))
    colours = [((31, 119, 180), (214, 39, 40)), ((255, 127, 14), (44, 160, 44))]
    for (tr, va), (ct, cv) in zip(runs, colours):
        for (a, b), (p, q) in zip(tr, tr[1:]):
            c.line(sx(a), sy(b), sx(p), sy(q), ct, 2)
        for (a, b), (p, q) in zip(va, va[1:]):
            c.line(sx(a), sy(b), sx(p), sy(q), cv, 1)
        for a, b in va:
            for dx in range(-3, 4):
                c.line(sx(a) + dx, sy(b) - 3, sx(a) + dx, sy(b) + 3, cv)
    c.text(W // 2 - 16, H - 18, "step")
    c.text(LEFT + 10, 8, "loss (nats/token)")
    c.line(W - 190, 14, W - 160, 14, (31, 119, 180), 2)
    c.text(W - 152, 10, "train", (31, 119, 180))
    c.line(W - 90, 14, W - 60, 14, (214, 39, 40), 2)
    c.text(W - 52, 10, "val", (214, 39, 40))
    if len(runs) > 1:
        c.line(W - 250, 30, W - 220, 30, colours[1][0], 2)
        c.text(W - 212, 26, "vs train", colours[1][0])
        c.line(W - 130, 30, W - 100, 30, colours[1][1], 2)
        c.text(W - 92, 26, "vs val", colours[1][1])
    with open(argv[2], "wb") as f:
        f.write(c.png())
    print("plot_loss: %d training and %d validation points%s -> %s" % (len(train), len(val),
          " and a second run's" if len(runs) > 1 else "", argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
