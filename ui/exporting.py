"""The export handler: the comparison's figures, its record and the overlay images written to a per-client
folder (`export.export_all`, `export_store.ExportStore`)."""
from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from .export import ALL_FORMATS, export_all
from .export_store import ExportStore
from .inputs import refuse
from .rendering import Renderer
from .runstate import Comparison, SessionBox

log = logging.getLogger(__name__)


class Exporter:
    """Needs the renderer (the figures and overlay images, drawn as the page shows them) and the export store
    (one folder per client)."""

    def __init__(self, renderer: Renderer, exports: ExportStore):
        self.renderer = renderer
        self.exports = exports

    def export(self, formats, box, request: gr.Request = None):
        comp = box.run if isinstance(box, SessionBox) else None
        if comp is None or comp.prefill is None:
            raise refuse("nothing to export yet: run a comparison first")
        if formats is not None and not isinstance(formats, (list, tuple)):
            raise refuse(f"formats must be a list of any of: {', '.join(ALL_FORMATS)}")
        formats = [f for f in (formats or ALL_FORMATS) if isinstance(f, str) and f in ALL_FORMATS]
        folder = self.exports.new_folder(box.owner_for(request))
        try:
            result = export_all(self.renderer.figures(comp, box), comp.to_dict(), formats,
                                images=self.images(comp), out_root=folder)
        except Exception as exc:  # noqa: BLE001
            log.exception("export failed")
            raise gr.Error(f"export failed ({exc.__class__.__name__}: {str(exc)[:200]})", print_exception=False) from None
        note = " ".join(result.messages)
        names = ", ".join(sorted({p.rsplit("/", 1)[-1] for p in result.files[1:]}))
        return (gr.update(value=result.files, visible=True),
                f"**Exported** {len(result.files) - 1} files + zip: {names}. {note}")

    def images(self, comp: Comparison) -> dict[str, Any]:
        """The overlay gallery's images, named by layer and method."""
        items = self.renderer.gallery(comp)
        if not items:
            return {}
        return {f"overlay-layer{comp.overlay.layer}-{m}": img
                for m, (img, _) in zip([m for m in comp.methods if comp.overlay.maps.get(m) is not None], items)}
