"""One palette and one typography for every chart, panel and export.

Each method declares its own colour (prefixkv_core.policies; the built-in ones follow the Okabe-Ito
colour-blind-safe palette where it has room, Full black, PrefixKV vermillion); names the registry does not
know get a stable colour from a small fallback list.
"""
from __future__ import annotations

import hashlib

from prefixkv_core.policies import method_colours

_FALLBACK = ("#999933", "#44AA99", "#882255", "#117733", "#332288", "#AA4499")

FONT_FAMILY = "Inter, Helvetica, Arial, sans-serif"
FONT = dict(family=FONT_FAMILY, size=13, color="#222222")
PAPER_FONT = dict(family="Helvetica, Arial, sans-serif", size=14, color="#000000")
GRID = "#e6e6e6"


def colour(method: str) -> str:
    """The colour of a method; unknown names get a stable colour from a small fallback list."""
    known = method_colours()
    if method in known:
        return known[method]
    digest = int(hashlib.sha1(method.encode()).hexdigest(), 16)
    return _FALLBACK[digest % len(_FALLBACK)]


def tint(hex_colour: str, amount: float) -> str:
    """Mix a #rrggbb colour with white: amount 0 -> the colour, 1 -> white."""
    h = hex_colour.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#{:02x}{:02x}{:02x}".format(*mix)


def rgba(hex_colour: str, alpha: float) -> str:
    h = hex_colour.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def layer_colours(n: int) -> list[str]:
    """n colours along a perceptually ordered ramp (shallow layers light, deep layers dark)."""
    ramp = ["#fde725", "#b5de2b", "#6ece58", "#35b779", "#1f9e89", "#26828e", "#31688e", "#3e4989",
            "#482878", "#440154"]
    if n <= 1:
        return [ramp[5]]
    return [ramp[round(i * (len(ramp) - 1) / (n - 1))] for i in range(n)]


def css() -> str:
    """Stylesheet for the Gradio app: badges, method panels with a coloured edge, compact headings."""
    per_method = "\n".join(
        f".method-panel.m-{name} {{ border-top: 4px solid {c} !important; }}\n"
        f".m-{name} .method-name {{ color: {c}; }}"
        for name, c in method_colours().items()
    )
    return f"""
.method-panel {{ border-radius: 8px; padding: 4px 8px 8px 8px !important; }}
.method-head {{ min-height: 58px; }}
.method-name {{ font-weight: 700; font-size: 1.05rem; }}
.method-sub {{ color: #666; font-size: 0.78rem; }}
.badges {{ display: flex; flex-wrap: wrap; gap: 4px; margin-top: 4px; }}
.badge {{ display: inline-block; padding: 1px 7px; border-radius: 10px; font-size: 0.78rem;
          background: #f1f3f5; color: #222; border: 1px solid #dde1e5; white-space: nowrap;
          font-variant-numeric: tabular-nums; }}
.badge.kv {{ background: #eef6ff; border-color: #cfe3ff; }}
.badge.rouge {{ background: #f2fbf4; border-color: #cdebd5; }}
.badge.alone {{ background: #fdf3ea; border-color: #f3d6bb; }}
.badge.state-streaming {{ background: #fff8e6; border-color: #ffe2a8; }}
.badge.state-prefilling {{ background: #eef4ff; border-color: #c5d7fb; }}
.badge.state-done {{ background: #eefaf0; border-color: #c7eccf; }}
.badge.state-error {{ background: #fdecec; border-color: #f5c2c2; color: #a40000; }}
.badge.state-stopped {{ background: #f3f0ff; border-color: #d9d0ff; }}
.method-note {{ color: #666; font-size: 0.75rem; margin-top: 2px; }}
.method-error {{ color: #a40000; font-size: 0.8rem; margin-top: 2px; }}
.banner-warn {{ color: #8a5300; }}
#status-line {{ min-height: 1.6em; }}
#panels {{ display: grid !important; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 12px; }}
@media (max-width: 900px) {{ #panels {{ grid-template-columns: minmax(0, 1fr); }} }}
#panels > .hidden, #panels > [hidden] {{ display: none !important; }}
.knob-title {{ margin-top: 6px; }}
[id^="chat-"] button[aria-label="Clear"] {{ display: none !important; }}
{per_method}
"""


def gradio_theme():
    """A quiet Gradio theme (imported lazily so the chart code does not need gradio)."""
    import gradio as gr

    # system fonts only: the page must load with no network (offline machines, air-gapped clusters)
    return gr.themes.Soft(primary_hue="orange", secondary_hue="slate", neutral_hue="slate",
                          text_size="sm", spacing_size="sm", radius_size="sm",
                          font=["Helvetica", "Arial", "sans-serif"],
                          font_mono=["Menlo", "DejaVu Sans Mono", "monospace"])
