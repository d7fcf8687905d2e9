"""The one error the model loader raises for a spec it cannot load."""


class ModelLoadError(ValueError):
    """The model spec cannot be loaded; the message names the problem and what is accepted."""
