"""attnkit.serve."""
