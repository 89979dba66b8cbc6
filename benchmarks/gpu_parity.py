"""Parity of the recipe's kernels with Hugging Face eager, forward and backward, on CUDA in bf16.

Each check builds a Hugging Face module (or model) once, from seed 0, and runs three
copies of it on the same inputs and the same output cotangent:

* the *reference*: Hugging Face eager in a wider dtype (float32 on a GPU, float64 on CPU);
* *HF eager* in the test dtype (bf16 on a GPU, float32 on CPU);
* the *kernel*: the slapo_fn replacement, built from a copy in the test dtype.

The error of a tensor is its largest absolute difference from the reference, divided by the
reference's largest absolute value. A kernel passes when, for the output and every
gradient (inputs and parameters), its error is at most twice HF eager's own error plus a
floor (``FLOOR``; the rule FlashAttention's tests use): rounding in the test dtype is
allowed, a wrong mask or a missed head group is not.

Checks (``--smoke``: small shapes, on CPU):

* ``attention/<backend>`` — :class:`~slapo_fn.kernels.RotaryAttention` (from a
  ``LlamaAttention``, GQA: 4 query heads per kv head, causal) against eager attention with
  its additive causal mask, with SDPA restricted to one backend (``flash``, ``cudnn``,
  ``efficient``, ``math``); a backend that cannot run the call is ``unsupported`` (its
  message kept), not a failure; ``attention/default`` lets SDPA choose, and
  ``default_kernels`` names the device kernels it ran;
* ``rmsnorm`` — :class:`~slapo_fn.kernels.RMSNorm` against ``LlamaRMSNorm``;
* ``fused_mlp`` — :class:`~slapo_fn.kernels.FusedMLP` against ``GPT2MLP``;
* ``chunked_cross_entropy`` — :func:`~slapo_fn.kernels.linear_cross_entropy` against the
  LM head's logits (float32) and ``F.cross_entropy``, with ignored labels;
* ``model`` — a 2-layer GQA LLaMA scheduled by its recipe with ``kernels=True`` and the
  chunked loss (:func:`~slapo_fn.kernels.causal_lm_loss`) against the eager model's own loss,
  with right padding in the attention mask (masked labels ignored): the masks as the models
  build them.

Prints one JSON line: per check its status (``pass``, ``FAIL``, ``unsupported``), the worst
ratio of kernel error to its allowance, and the errors of the worst tensor; ``ok`` is true
when no check failed and at least one fused attention backend (flash or cuDNN on a GPU)
passed.

    python benchmarks/gpu_parity.py            # needs CUDA
    python benchmarks/gpu_parity.py --smoke    # the script's logic on CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import slapo_fn as sf
from slapo_fn.kernels import FusedMLP, RMSNorm, RotaryAttention, causal_lm_loss, linear_cross_entropy

#: Error allowed beyond twice Hugging Face eager's own, relative to the reference's scale.
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BACKENDS = ("flash", "efficient", "math", "cudnn")  # cuDNN last: the youngest
#: A module's outputs and the gradients to compare: name -> tensor.
Tensors = dict[str, torch.Tensor]


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.detach().double().abs().max().clamp_min(1e-12)
    return float((x.detach().double() - ref.detach().double()).abs().max() / scale)


def compare(ref: Tensors, hf: Tensors, kernel: Tensors, dtype: torch.dtype) -> dict[str, Any]:
    """The check's verdict from the three runs' tensors (same names)."""
    worst: tuple[float, str, float, float] = (-1.0, "", 0.0, 0.0)
    for name, r in ref.items():
        if name not in kernel:
            return {"status": "FAIL", "reason": f"the kernel has no {name!r}"}
        hf_err, k_err = _error(hf[name], r), _error(kernel[name], r)
        ratio = k_err / (2 * hf_err + FLOOR[dtype])
        if ratio > worst[0]:
            worst = (ratio, name, k_err, hf_err)
    ratio, name, k_err, hf_err = worst
    return {"status": "pass" if ratio <= 1 else "FAIL", "worst_ratio": round(ratio, 3), "worst_tensor": name,
            "kernel_error": float(f"{k_err:.3g}"), "hf_eager_error": float(f"{hf_err:.3g}"), "tensors": len(ref)}


def _grads(module: nn.Module, inputs: dict[str, torch.Tensor], out: torch.Tensor, cotangent: torch.Tensor
           ) -> Tensors:
    (out.float() * cotangent.float()).sum().backward()
    found = {"out": out}
    found.update({f"grad.{k}": v.grad for k, v in inputs.items() if v.grad is not None})
    found.update({f"grad.{n}": p.grad for n, p in module.named_parameters() if p.grad is not None})
    return found  # type: ignore[return-value]


def _leaves(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype).requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}


def module_check(hf: nn.Module, kernel_of: Callable[[nn.Module], nn.Module], inputs: dict[str, torch.Tensor],
                 call: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor], ref_dtype: torch.dtype,
                 dtype: torch.dtype) -> dict[str, Any]:
    """``hf`` in ``ref_dtype`` and ``dtype`` against ``kernel_of(copy of hf in dtype)``."""
    runs = []
    for which in ("ref", "hf", "kernel"):
        d = ref_dtype if which == "ref" else dtype
        module = copy.deepcopy(hf).to(d)
        if which == "kernel":
            module = kernel_of(module)
        leaves = _leaves(inputs, d)
        out = call(module, leaves)
        cot = torch.Generator(device="cpu").manual_seed(1)
        cotangent = torch.randn(out.shape, generator=cot, dtype=torch.float32).to(out.device)
        runs.append(_grads(module, leaves, out, cotangent))
    ref, hf_run, kernel_run = runs
    return compare(ref, hf_run, kernel_run, dtype)


@torch.no_grad()
def _causal_additive(seq: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None]


def attention_checks(shape: dict[str, int], ref_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
                     ) -> Iterator[tuple[str, dict[str, Any]]]:
    """``RotaryAttention`` against eager ``LlamaAttention``, per SDPA backend, GQA, causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["heads"] // 4, attn_implementation="eager")
    hf = LlamaAttention(cfg, layer_idx=0).to(device)
    batch, seq = shape["batch"], shape["seq"]
    x = torch.randn(batch, seq, shape["hidden"], device=device)
    rope = LlamaRotaryEmbedding(cfg).to(device)
    cos, sin = rope(x, torch.arange(seq, device=device)[None].expand(batch, -1))

    def call(m: nn.Module, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        h = inp["hidden"]
        emb = (cos.to(h.dtype), sin.to(h.dtype))
        if isinstance(m, RotaryAttention):
            return m(h, emb, None)[0]  # type: ignore[no-any-return]
        return m(h, emb, _causal_additive(seq, h.dtype, h.device))[0]  # type: ignore[no-any-return]

    def kernel(m: nn.Module) -> nn.Module:
        return RotaryAttention.from_hf(m, "self_attn")

    result = module_check(hf, kernel, {"hidden": x}, call, ref_dtype, dtype)
    result["default_kernels"] = _kernels_of(lambda: call(kernel(copy.deepcopy(hf).to(dtype)), {"hidden": x.to(dtype)}),
                                            device)
    yield "attention/default", result
    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}
    for backend in BACKENDS:
        chosen = getattr(SDPBackend, names[backend], None)
        if chosen is None:
            yield f"attention/{backend}", {"status": "unsupported", "reason": "not in this torch's SDPBackend"}
            continue
        try:
            with sdpa_kernel([chosen]):
                result = module_check(hf, kernel, {"hidden": x}, call, ref_dtype, dtype)
        except RuntimeError as e:
            result = {"status": "unsupported", "reason": str(e).strip().splitlines()[0][:300]}
        yield f"attention/{backend}", result


def _kernels_of(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """Names of the device kernels (CUDA) or attention ops (CPU) that ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    words = ("flash", "fmha", "cudnn", "attention", "attn", "sdpa", "softmax")
    names = {e.key for e in prof.key_averages() if any(w in e.key.lower() for w in words)}
    return sorted(n[:100] for n in names)[:12]


def rmsnorm_check(shape: dict[str, int], ref_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
                  ) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(shape["hidden"]).to(device)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device)
    return module_check(hf, RMSNorm.from_hf, {"x": x}, lambda m, i: m(i["x"]), ref_dtype, dtype)


def mlp_check(shape: dict[str, int], ref_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
              ) -> dict[str, Any]:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=shape["hidden"], resid_pdrop=0.0)
    hf = GPT2MLP(4 * shape["hidden"], cfg).to(device)
    x = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device)
    return module_check(hf, FusedMLP.from_hf, {"x": x}, lambda m, i: m(i["x"]), ref_dtype, dtype)


class _Head(nn.Module):
    """An LM head and its loss as Hugging Face computes it (float32 logits), or chunked."""

    def __init__(self, hidden: int, vocab: int, chunked: bool = False) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.chunked = chunked

    def forward(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.chunked:
            return linear_cross_entropy(h, self.lm_head.weight, target)
        return F.cross_entropy(self.lm_head(h).float().flatten(0, -2), target.flatten())


def cross_entropy_check(shape: dict[str, int], ref_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
                        ) -> dict[str, Any]:
    torch.manual_seed(0)
    hf = _Head(shape["hidden"], shape["vocab"]).to(device)
    h = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device)
    target = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)
    target[:, -3:] = -100  # ignored positions, as padding gives

    def kernel(m: nn.Module) -> nn.Module:
        m.chunked = True  # type: ignore[assignment]
        return m

    return module_check(hf, kernel, {"h": h, "target": target}, lambda m, i: m(i["h"], i["target"]), ref_dtype,
                        dtype)


def model_check(shape: dict[str, int], ref_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
                ) -> dict[str, Any]:
    """The recipe's kernels in a whole model, with the masks the models build (right padding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=2 * shape["hidden"],
                      num_hidden_layers=2, num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["heads"] // 4, use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device)
    batch, seq = shape["batch"], shape["seq"]
    ids = torch.randint(0, shape["vocab"], (batch, seq), device=device)
    pad = torch.ones(batch, seq, dtype=torch.long, device=device)
    pad[0, -seq // 4:] = 0  # the first row ends in padding
    labels = ids.masked_fill(pad == 0, -100)
    runs = []
    for which in ("ref", "hf", "kernel"):
        d = ref_dtype if which == "ref" else dtype
        m = copy.deepcopy(model).to(d)
        m.set_attn_implementation("eager")
        if which == "kernel":
            m.set_attn_implementation("sdpa")  # the implementation the recipe's kernels are built for
            m = sf.build(sf.recipes.for_model(m)(sf.create_schedule(m), kernels=True), device=device)
            loss = causal_lm_loss(m, ids, labels, attention_mask=pad)
        else:
            loss = m(input_ids=ids, attention_mask=pad, labels=labels).loss
        loss.backward()
        found = {"loss": loss.detach().reshape(1)}
        found.update({f"grad.{n}": p.grad for n, p in m.named_parameters() if p.grad is not None})
        runs.append(found)
    ref, hf_run, kernel_run = runs
    return compare(ref, hf_run, kernel_run, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes on CPU in float32: checks the script only")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_parity.py needs a CUDA device (or --smoke to check the script on CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    ref_dtype, dtype = (torch.float64, torch.float32) if args.smoke else (torch.float32, torch.bfloat16)
    shape = ({"batch": 2, "seq": 16, "hidden": 64, "heads": 8, "vocab": 96} if args.smoke else
             {"batch": 2, "seq": 1024, "hidden": 1024, "heads": 16, "vocab": 32000})
    checks: dict[str, Any] = {}
    start = time.perf_counter()

    def record(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            checks[name] = fn()
        except Exception as e:  # one broken check must not hide the others' results
            checks[name] = {"status": "FAIL", "reason": f"{type(e).__name__}: {str(e).strip()[:300]}"}

    record("rmsnorm", lambda: rmsnorm_check(shape, ref_dtype, dtype, device))
    record("fused_mlp", lambda: mlp_check(shape, ref_dtype, dtype, device))
    record("chunked_cross_entropy", lambda: cross_entropy_check(shape, ref_dtype, dtype, device))
    record("model", lambda: model_check({**shape, "seq": min(shape["seq"], 512)}, ref_dtype, dtype, device))
    # last: a backend that breaks the CUDA context fails only what comes after it
    try:
        for name, result in attention_checks(shape, ref_dtype, dtype, device):
            checks[name] = result
    except Exception as e:
        checks["attention"] = {"status": "FAIL", "reason": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    fused = ("flash", "cudnn") if device.type == "cuda" else BACKENDS
    ok = (not any(c["status"] == "FAIL" for c in checks.values())
          and any(checks.get(f"attention/{b}", {}).get("status") == "pass" for b in fused))
    print(json.dumps({"benchmark": "gpu_parity", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                      else "cpu", "torch": torch.__version__, "dtype": str(dtype), "reference_dtype": str(ref_dtype),
                      "shape": shape, "ok": ok, "seconds": round(time.perf_counter() - start, 1), "checks": checks}),
          flush=True)


if __name__ == "__main__":
    main()
