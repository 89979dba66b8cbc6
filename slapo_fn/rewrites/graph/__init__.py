"""Static-graph primitives: trace by need, then find, fuse, decompose, and partial
``replace`` / ``checkpoint`` of matched subgraphs (on ``torch.fx``)."""

from .decompose import decompose
from .find import Match, call_module, find
from .fuse import fuse
from .trace import TraceFallbackWarning, trace

__all__ = ["Match", "TraceFallbackWarning", "call_module", "decompose", "find", "fuse", "trace"]
