"""What every role uses and none owns: user errors (``errors``), atomic file writes (``files``), small
numeric helpers (``numeric``) and what a measurement records about itself (``measure``: date, commit,
peak RSS). Imports nothing else of attnkit."""
