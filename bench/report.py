"""What every benchmark prints the same way: its targets, met or missed, and numbers that may be absent."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["num", "targets_line"]


def targets_line(targets: Mapping[str, bool | None]) -> str:
    """``targets: name=met, name=MISSED, name=-`` (``-``: not measured in this run)."""
    verdicts = ("-" if met is None else ("met" if met else "MISSED") for met in targets.values())
    return "targets: " + ", ".join(
        f"{name}={verdict}" for name, verdict in zip(targets, verdicts, strict=True)
    )


def num(value: object, fmt: str) -> str:
    """``value`` formatted with ``fmt``, or ``-`` when it is not a number (a run that did not give it)."""
    return format(value, fmt) if isinstance(value, int | float) else "-"
