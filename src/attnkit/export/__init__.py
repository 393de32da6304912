"""attnkit.export."""
