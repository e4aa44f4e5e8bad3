"""The one exception type for mistakes a user can make (config, data, checkpoint paths).

Entry points turn it into a one-line message and a non-zero exit; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message names the culprit and says what to do.

    `all_ranks=True` marks an error every rank raises together (a decision rank 0 broadcast):
    rank 0 alone reports it. `before_group=True` marks one a rank meets alone before any process group
    exists (it could not join the others): that rank reports it, whatever its rank.
    """

    def __init__(self, message: str, *, all_ranks: bool = False, before_group: bool = False) -> None:
        super().__init__(message)
        self.all_ranks = all_ranks
        self.before_group = before_group


class UnreadableCheckpoint(UserError):
    """A checkpoint that exists but does not load (truncated, cut short, or not a checkpoint)."""
