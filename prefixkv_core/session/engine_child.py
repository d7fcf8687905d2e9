"""The engine process's entry point (`engine_process.EngineProcess` starts it):

    python -m prefixkv_core.session.engine_child FD SPEC

FD: this end of the socket pair to the parent; SPEC: JSON with the model, device, dtype, threads and loader."""
from __future__ import annotations

import json
import sys
from multiprocessing.connection import Connection

from prefixkv_core.session.engine_process import child_main

if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    child_main(Connection(int(sys.argv[1])), spec["model"], spec["device"], spec["dtype"], spec["threads"],
               spec["loader"])
