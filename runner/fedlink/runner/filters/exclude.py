"""A filter that leaves variables out of a result, e.g. personalised layers that stay on the device."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

from fedlink.common.dxo import DXO, DataKind, MetaValue
from fedlink.common.errors import InvalidArgument
from fedlink.runner.context import Context, Signal

__all__ = ["ExcludeVariables"]


class ExcludeVariables:
    """Drops the variables whose names match from a ``WEIGHTS`` or ``WEIGHT_DIFF`` DXO.

    What it does to the data: removes every variable (and its encoding) whose name equals one of
    ``names``, matches one of the shell-style ``globs`` (``fnmatch``, case-sensitive, e.g.
    ``"head.*"``) or fully matches one of the regular expressions ``regexes``. Everything else is
    untouched. Meta ``excluded_variables`` lists the names removed (sorted). Other kinds pass through.

    The coordinator averages each variable over the results that carry it, so an excluded variable
    simply does not contribute from this device: the global value moves only with the devices that
    sent it (and stays as it was if none did). Excluding every variable is an error, since the result
    would carry nothing.
    """

    def __init__(
        self,
        names: Sequence[str] = (),
        globs: Sequence[str] = (),
        regexes: Sequence[str] = (),
    ) -> None:
        """Give the names and patterns to drop (at least one).

        Raises:
            InvalidArgument: None given, a non-string entry, or a regular expression that does not compile.
        """
        for what, items in (("names", names), ("globs", globs), ("regexes", regexes)):
            if isinstance(items, str) or not all(isinstance(item, str) for item in items):
                raise InvalidArgument(f"ExcludeVariables {what} must be a list of strings, got {items!r}")
        if not (names or globs or regexes):
            raise InvalidArgument("ExcludeVariables needs at least one of names, globs or regexes")
        self.names = frozenset(names)
        self.globs = tuple(globs)
        try:
            self.regexes = tuple(re.compile(pattern) for pattern in regexes)
        except re.error as exc:
            raise InvalidArgument(f"ExcludeVariables: bad regular expression: {exc}") from None

    def matches(self, name: str) -> bool:
        """Whether ``name`` is excluded."""
        return (
            name in self.names
            or any(fnmatch.fnmatchcase(name, glob) for glob in self.globs)
            or any(regex.fullmatch(name) for regex in self.regexes)
        )

    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Remove the matching variables (see the class doc)."""
        abort_signal.check()
        if dxo.kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
            return dxo
        excluded = sorted(name for name in dxo.data if self.matches(name))
        if excluded and len(excluded) == len(dxo.data):
            raise InvalidArgument(f"ExcludeVariables would remove every variable ({excluded})")
        data = {name: value for name, value in dxo.data.items() if name not in excluded}
        encodings = {name: enc for name, enc in dxo.encodings.items() if name in data}
        meta: dict[str, MetaValue] = {**dxo.meta, "excluded_variables": list(excluded)}
        return DXO(kind=dxo.kind, data=data, meta=meta, encodings=encodings)
