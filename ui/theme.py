"""One colour per method, shared by every chart and panel."""
METHOD_COLOURS = {
    "full": "#4d4d4d", "local": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#2ca02c", "pyramidkv": "#17becf",
    "elastic": "#9467bd", "lookm": "#8c564b", "zipvl": "#e377c2", "prefixkv": "#d62728",
}
FONT = dict(family="Helvetica, Arial, sans-serif", size=13)


def colour(method: str) -> str:
    return METHOD_COLOURS.get(method, "#7f7f7f")
