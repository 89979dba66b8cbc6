"""What this process's GPU can run: the levers that need one, refused with the reason elsewhere.

* float8 linears (:mod:`.float8`): torchao, and a CUDA GPU of compute capability 8.9 or
  more (Ada, Hopper, Blackwell), whose ``torch._scaled_mm`` float8 matmuls are the point
  (torchao runs elsewhere only by emulating them, slower than bf16);
* async tensor parallelism (inductor's micro-pipelined all-gather→matmul and
  matmul→reduce-scatter): a CUDA GPU, whose symmetric memory the fused kernels use.

Each check returns a :class:`~slapo_fn.errors.Problem` naming the knob or flag that asked
(``what``), or ``None`` where the lever runs.
"""

from __future__ import annotations

import importlib.util

import torch

from ..errors import Problem

__all__ = ["MIN_FLOAT8_CAPABILITY", "async_tp_problem", "float8_problem"]

#: The CUDA compute capability of the first GPUs with float8 tensor cores (Ada: sm_89).
MIN_FLOAT8_CAPABILITY = (8, 9)


def float8_problem(what: str = "float8") -> Problem | None:
    """Why this process cannot train with float8 linears (``what``: the knob or flag that
    asks for them), or ``None``: torchao missing, no CUDA GPU, or one older than sm_89."""
    if importlib.util.find_spec("torchao") is None:
        return Problem(what, "needs torchao (torchao.float8), which is not installed",
                       "pip install torchao (it pulls no other torch), or drop " + what)
    if not torch.cuda.is_available():
        return Problem(what, "float8 matmuls run on CUDA GPUs of compute capability 8.9 or more (Ada, Hopper, "
                             "Blackwell); this process has no CUDA GPU (on a CPU they would only be emulated)",
                       f"drop {what}, or run on an sm_89+ GPU")
    cap = tuple(torch.cuda.get_device_capability())
    if cap < MIN_FLOAT8_CAPABILITY:
        return Problem(what, f"the GPU {torch.cuda.get_device_name()!r} has compute capability {cap[0]}.{cap[1]}; "
                             "float8 matmuls need 8.9 or more (Ada, Hopper, Blackwell)",
                       f"drop {what} (bf16 is the fastest format on this GPU), or run on an sm_89+ GPU")
    return None


def async_tp_problem(what: str = "async_tp") -> Problem | None:
    """Why this process cannot run micro-pipelined tensor parallelism (``None`` where it
    can): it fuses collectives over CUDA symmetric memory, so it needs a CUDA GPU."""
    if not torch.cuda.is_available():
        return Problem(what, "async tensor parallelism fuses the all-gathers and reduce-scatters with their matmuls "
                             "over CUDA symmetric memory; this process has no CUDA GPU",
                       f"drop {what}, or run on CUDA GPUs")
    return None
