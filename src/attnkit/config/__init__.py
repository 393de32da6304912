"""attnkit.config."""
