"""Rewrite primitives: each ``f(sch, where, /, ..., *, options) -> Schedule``."""

from .annotate import annotate
from .checkpoint import checkpoint
from .compile import compile  # noqa: A004
from .hook import hook
from .replace import replace

__all__ = ["annotate", "checkpoint", "compile", "hook", "replace"]
