"""The engine as an lmms-eval model (`--model prefixkv`) and what is built on it: sweeps of methods and budgets
decoded together, agreement with the uncompressed model, leaderboard rows.

Only `lmms_model.py`, `registration.py` and `sweep.py` import lmms-eval, and only when they are imported: the
engine and the rest of this package run without it."""
