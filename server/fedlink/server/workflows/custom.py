"""Workflows of the operator's own, named by import path: ``pkg.module:factory``.

A factory is a callable that takes the job's config (a JSON object) and returns a
:class:`~fedlink.server.workflows.base.Workflow`; it raises ``ValueError``, ``TypeError`` or
:class:`~fedlink.common.errors.InvalidArgument` for a config it refuses. The coordinator calls it once at
submission, to check the config, and again whenever it drives a run of the job.

That is code running inside the coordinator, so a job may name it only if the operator allowed its
module: the ``allow_workflows`` setting holds ``fnmatch`` patterns of module names (``"mypkg.*"``,
``"flows.cyclic"``); anything else is refused with FAILED_PRECONDITION before the module is imported.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.workflows.base import Workflow

#: The setting that allows import-path workflows (named in every refusal).
SETTING = "allow_workflows"
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

Factory = Callable[[Mapping[str, Any]], Workflow]


def split_import_path(path: str) -> tuple[str, str]:
    """``"pkg.module:factory"`` as its module and attribute.

    Raises:
        InvalidArgument: not of that form.
    """
    if not _IMPORT_PATH.fullmatch(path):
        raise InvalidArgument(f"workflow {path!r} is not an import path of the form pkg.module:factory")
    module, _, attribute = path.partition(":")
    return module, attribute


def check_allowed(path: str, patterns: tuple[str, ...]) -> None:
    """Refuses an import-path workflow whose module no pattern of ``allow_workflows`` matches.

    Raises:
        InvalidArgument: ``path`` is not an import path.
        FailedPrecondition: the module is not allowed (the message names the setting).
    """
    module, _ = split_import_path(path)
    if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
        return
    allowed = ", ".join(repr(p) for p in patterns) if patterns else "nothing"
    raise FailedPrecondition(
        f"workflow {path!r} runs code in the coordinator, and its {SETTING} setting ({allowed}) does not "
        f"allow module {module!r}: add {module!r} (or a pattern such as '{module.split('.')[0]}.*') to "
        f"{SETTING} (FEDLINK_ALLOW_WORKFLOWS) and restart the coordinator"
    )


@dataclass(frozen=True, slots=True)
class CustomWorkflow:
    """An imported workflow factory."""

    path: str
    factory: Factory

    def build(self, config: Mapping[str, Any]) -> Workflow:
        """The driver of one run with ``config``.

        Raises:
            InvalidArgument: the factory refused the config, or did not return a workflow.
        """
        try:
            workflow = self.factory(config)
        except InvalidArgument as exc:
            raise InvalidArgument(f"workflow {self.path!r} refused its config: {exc.message}") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidArgument(f"workflow {self.path!r} refused its config: {exc}") from None
        if not callable(getattr(workflow, "run", None)):
            raise InvalidArgument(
                f"workflow factory {self.path!r} returned {type(workflow).__name__}, which has no "
                "async run(ctx) method"
            )
        return workflow

    def check(self, config: Mapping[str, Any]) -> None:
        """Builds a driver for ``config`` and drops it: the factory's own checks, at submission."""
        self.build(config)


def load_factory(path: str) -> CustomWorkflow:
    """Imports the factory an import path names (call :func:`check_allowed` first).

    Raises:
        InvalidArgument: the module cannot be imported, or has no such callable.
    """
    module_name, attribute = split_import_path(path)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the module's own code raised
        raise InvalidArgument(
            f"workflow {path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidArgument(f"workflow {path!r}: module {module_name!r} has no {attribute!r}") from None
    if not callable(target):
        raise InvalidArgument(f"workflow {path!r}: {attribute!r} is not callable")
    return CustomWorkflow(path, target)
