"""attnkit.training."""
