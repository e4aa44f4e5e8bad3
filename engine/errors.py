"""The one exception type for mistakes a user can make (config, data, checkpoint paths).

Entry points turn it into a one-line message and a non-zero exit; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message names the culprit and says what to do."""
