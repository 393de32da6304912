"""Configuration: the YAML loader (``loader``: typed dataclasses, ``KEY=VALUE`` overrides, errors that name
the key) and the run's schema (``schema``: ``RunConfig`` with its data, model, mlm and train sections)."""
