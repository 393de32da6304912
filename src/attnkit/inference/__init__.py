"""attnkit.inference."""
