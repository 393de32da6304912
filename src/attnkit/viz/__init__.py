"""attnkit.viz."""
