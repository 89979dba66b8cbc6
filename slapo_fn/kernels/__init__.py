"""Drop-in replacement modules, used through :func:`slapo_fn.replace`."""

from .rmsnorm import RMSNorm

__all__ = ["RMSNorm"]
