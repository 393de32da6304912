"""attnkit.runs."""
