"""Attention made visible: ``plot`` (pure heatmap functions), ``figures`` (every kind, layer and head of
:class:`~attnkit.inference.attention_maps.AttentionMaps` as figures) and ``explorer`` (one self-contained
HTML page to explore them)."""
