"""The sweep's artifact: sweep.json (validated against artifact.schema.json), sweep.csv and
sweep.png (step time against K per batch size). Written after every point, atomically,
so a failure mid-sweep never loses the rows already measured."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

SCHEMA_PATH = Path(__file__).with_name("artifact.schema.json")


def build_artifact(rows, meta: dict, config: dict, status: str, error: str | None = None) -> dict:
    measured = [r for r in rows if not r.kv_seed_regime.startswith("skip:")]
    skipped = [r for r in rows if r.kv_seed_regime.startswith("skip:")]

    def point(r):
        return {"total_kv_read_tokens": r.total_kv_read_tokens, "batch_size": r.batch_size}

    return {
        "schema_version": 1, "status": status, "error": error, "config": config,
        "kvwarm": {**meta, "points_real_kv": sum(r.kv_seed_regime == "real_kv" for r in measured),
                   "points_fake_fallback": sum(r.kv_seed_regime == "fake_fallback" for r in measured)},
        "results": [{"point": point(r), "kv_seed_regime": r.kv_seed_regime, "sample_reasons": r.sample_reasons,
                     "steady_seconds": r.steady_seconds, "median_seconds": r.median_seconds} for r in measured],
        "skipped_points": [{"point": point(r), "kv_seed_regime": r.kv_seed_regime, "reason": r.detail or ""}
                           for r in skipped],
    }


def validate(artifact: dict) -> None:
    import jsonschema

    jsonschema.validate(artifact, json.loads(SCHEMA_PATH.read_text()))


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_artifact(out_dir: str | Path, artifact: dict) -> list[Path]:
    validate(artifact)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "sweep.json", json.dumps(artifact, indent=2).encode())
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["total_kv_read_tokens", "batch_size", "kv_seed_regime", "median_ms", "steady_ms", "sample_reasons"])
    for row in artifact["results"]:
        writer.writerow([row["point"]["total_kv_read_tokens"], row["point"]["batch_size"], row["kv_seed_regime"],
                         f"{row['median_seconds'] * 1e3:.4f}",
                         " ".join(f"{t * 1e3:.4f}" for t in row["steady_seconds"]), " ".join(row["sample_reasons"])])
    _atomic_write(out / "sweep.csv", text.getvalue().encode())
    _atomic_write(out / "sweep.png", plot(artifact["results"]))
    return [out / "sweep.json", out / "sweep.csv", out / "sweep.png"]


COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def plot(results: list[dict], size=(800, 500)) -> bytes:
    """A PNG of median step time (ms) against K, one line per batch size; fake-KV points
    dashed grey markers."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = 70, 30, size[0] - 150, size[1] - 50
    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text((left, 8), "decode step time (median ms) vs KV tokens read (K)", fill="black")
    if results:
        ks = [r["point"]["total_kv_read_tokens"] for r in results]
        ms = [r["median_seconds"] * 1e3 for r in results]
        k_max, ms_max = max(ks), max(ms) * 1.1 or 1.0

        def xy(k, m):
            return left + (right - left) * k / k_max, bottom - (bottom - top) * m / ms_max

        for axis_k in (0, k_max):
            draw.text((xy(axis_k, 0)[0] - 10, bottom + 8), str(axis_k), fill="black")
        draw.text((8, top), f"{ms_max:.2f}", fill="black")
        draw.text((8, bottom - 10), "0", fill="black")
        batches = sorted({r["point"]["batch_size"] for r in results})
        for n, batch in enumerate(batches):
            colour = COLOURS[n % len(COLOURS)]
            line = sorted((r["point"]["total_kv_read_tokens"], r["median_seconds"] * 1e3, r["kv_seed_regime"])
                          for r in results if r["point"]["batch_size"] == batch)
            points = [xy(k, m) for k, m, _ in line]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            for (x, y), (_, _, regime) in zip(points, line):
                dot = colour if regime == "real_kv" else (150, 150, 150)
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=dot)
            draw.text((right + 15, top + 18 * n), f"B={batch}", fill=colour)
        draw.text((right + 15, top + 18 * len(batches) + 10), "grey: fake KV", fill=(150, 150, 150))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
