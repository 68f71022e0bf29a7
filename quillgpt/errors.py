"""The one exception type that means "the user did something wrong"."""


class QuillError(Exception):
    """A user mistake: the CLI prints its one-line message and exits with code 2.

    The message should name what is wrong and how to fix it. Anything that is
    *not* a QuillError is a bug and keeps its traceback.
    """
