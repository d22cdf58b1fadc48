"""Errors a user can cause while loading a model. Each message names the cause and the fix in one line."""


class LoadError(Exception):
    pass


class UnsupportedModel(LoadError):
    pass
