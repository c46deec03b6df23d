"""What megarl's exceptions share: they cross process boundaries intact.

An exception raised in a Ray worker (or a spawned rank) reaches the driver pickled. Python pickles an exception as
``cls(*self.args)`` plus its ``__dict__``; one whose ``__init__`` takes more than its message (keyword-only fields:
an engine's name and URL, a worker's role and rank) cannot be rebuilt that way, and Ray then replaces it with an
``UnserializableException`` that names none of it. :class:`FieldsError` rebuilds such an exception from its
arguments and fields without calling ``__init__``. ``tests/unit/test_errors.py`` round-trips every exception class
megarl defines.
"""

from __future__ import annotations

from typing import Any


class FieldsError:
    """Mixin (before the builtin exception base) for an exception whose ``__init__`` takes more than ``args``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[BaseException], args: tuple, fields: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error
