"""User-facing errors.

A :class:`UserError` is something the *user* can fix (a bad file, key or flag). The CLI
prints its message as one line and exits with status 2, without a traceback. Anything
else is a bug in attnkit and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input: the message names the file, line or key and the fix."""
