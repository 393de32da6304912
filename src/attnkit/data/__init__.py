"""attnkit.data."""
