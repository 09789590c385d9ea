"""Functions named by import paths in configs (a task's reward, a serve redaction hook)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any


def import_path(path: str, what: str) -> Callable[..., Any]:
    """The function an import path `pkg.module:function` names (the working directory is on the module
    path, as for task names). A path that names nothing callable is a one-line ValueError."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must be an import path like my_pkg.my_module:my_function, got {path!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}={path!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{what}={path!r} is not callable")
    return fn
