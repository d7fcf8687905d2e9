"""Plain texts the project reads from the interpreter rather than from a download: ``long_text`` (the Python
Language Reference, the long text of the quality benchmark's text mode and of the training's text check)."""
