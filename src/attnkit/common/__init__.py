"""attnkit.common."""
