"""The engine's own error: bad input, with a message that says what was wrong and what is accepted."""
from __future__ import annotations


class EngineError(ValueError):
    """Bad input to the engine; the message says what was wrong and what is accepted."""
