"""The error a user's input causes. Commands show it as one line; any other exception is a bug and keeps its
traceback."""


class InputError(ValueError):
    """A value the user gave (a flag, a file, a model's limit it runs into) that cannot work. The message names
    the cause and the fix."""
