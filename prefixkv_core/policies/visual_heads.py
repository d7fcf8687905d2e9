"""SparseMM's offline visual-head scores on disk: per model, how often each KV head of each layer looks at the part
of the image the model is naming, one JSON file in assets/visual_heads/<model-slug>.json (written by
`python -m prefixkv_core calibrate-heads`, read by SparseMM through `resolve`)."""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path

from ..models.assets import ASSETS
from .prefix_configs import SHAPES_OF

HEADS_ROOT = ASSETS / "visual_heads"


@dataclass
class HeadScores:
    scores: list[list[float]]  # [layer][KV head], >= 0
    source: str  # the file read


def heads_path(slug: str, root: Path = HEADS_ROOT) -> Path:
    return root / f"{slug}.json"


def load_head_scores(slug: str, num_layers: int, kv_heads: int | None = None, root: Path = HEADS_ROOT
                     ) -> HeadScores | None:
    """The model's visual-head scores (random weights in a calibrated model's shapes read that model's), or None
    when it has none. Raises ValueError when the file's shape is not the model's (`kv_heads` None: any count of
    KV heads, the same in every layer)."""
    path = heads_path(slug, root)
    if not path.is_file() and slug in SHAPES_OF:
        path = heads_path(SHAPES_OF[slug], root)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    scores = [[float(x) for x in row] for row in data["scores"]]
    heads = kv_heads if kv_heads is not None else (len(scores[0]) if scores else 0)
    if len(scores) != num_layers or not heads or any(len(row) != heads for row in scores):
        raise ValueError(f"{path} scores {len(scores)} layers of {len(scores[0]) if scores else 0} KV heads; the "
                         f"model has {num_layers} layers of {kv_heads}")
    return HeadScores(scores, str(path))


def write_head_scores(slug: str, model_name: str, scores: list[list[float]], extra: dict,
                      root: Path = HEADS_ROOT) -> Path:
    """Write a model's scores with what produced them (`extra`: samples, hits, the rule)."""
    path = heads_path(slug, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": model_name, "slug": slug, "date": _dt.date.today().isoformat(),
               "layers": len(scores), "kv_heads": len(scores[0]) if scores else 0,
               "scores": [[round(float(x), 6) for x in row] for row in scores]}
    payload.update(extra)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
