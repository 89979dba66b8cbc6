"""The boundary plan and the tensor-parallel build phase, under their former module name.

The plan (a pure function of a schedule) lives in :mod:`slapo_fn.dtensor.plan`, the
installed forwards in :mod:`slapo_fn.dtensor.runtime`; both are re-exported here.
"""

from .checks import implicit, refusals
from .plan import plan
from .planned import Boundary, ModulePlan, Plan
from .runtime import apply_tensor_parallel

__all__ = ["Boundary", "ModulePlan", "Plan", "apply_tensor_parallel", "implicit", "plan", "refusals"]
