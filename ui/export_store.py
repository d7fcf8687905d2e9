"""Where exports are written, and removing them: one private folder per export under a root made for this
server, at most one kept per client (the previous one goes when the client exports again or leaves) and
at most `max_folders` overall (oldest first). Gradio copies the files it offers for download into its own
cache, whose age limit the app sets, so a folder can go once its export has been answered."""
from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict


class ExportStore:
    def __init__(self, max_folders: int = 32):
        self.max_folders = max(1, int(max_folders))
        self.root = tempfile.mkdtemp(prefix="prefixkv-exports-")
        self._by_owner: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)  # also at interpreter exit

    def new_folder(self, owner: str) -> str:
        """A fresh, empty folder for `owner`'s export; removes that owner's previous one."""
        with self._lock:
            stale = [self._by_owner.pop(owner)] if owner in self._by_owner else []
            while len(self._by_owner) >= self.max_folders:
                stale.append(self._by_owner.popitem(last=False)[1])
            folder = tempfile.mkdtemp(prefix="export-", dir=self.root)
            self._by_owner[owner] = folder
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return folder

    def forget(self, owner: str | None) -> None:
        """`owner` left: remove its folder."""
        with self._lock:
            path = self._by_owner.pop(owner, None) if owner is not None else None
        if path:
            shutil.rmtree(path, ignore_errors=True)

    def folders(self) -> list[str]:
        with self._lock:
            return list(self._by_owner.values())

    def close(self) -> None:
        self._finalizer()
