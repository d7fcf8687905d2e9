"""Training of the embedded model's vision tower and projector on synthetic scenes (see train_embedded.py)."""
