"""GPU figures in one run: parity, throughput, explain against the run, and the training job.

``benchmarks/gpu_check.sh OUT`` sets up and calls this; it runs the parts below in order,
each in processes of its own under a time limit, so that a part that fails, crashes or
hangs leaves the others' figures. ``OUT/gpu_check.json`` is rewritten after every part
(what was done so far, each part's status, seconds and error) and ``OUT/gpu_check.log``
holds what this prints; the profiles of the throughput part land in ``OUT`` too (at most
four files in all).

0. ``header`` — device, driver, CUDA and torch versions, the Python packages present
   (optional ones included) and where transformers comes from; printed first.
1. ``parity`` — ``benchmarks/gpu_parity.py``: the recipe's kernels against Hugging Face
   eager, forward and backward, in bf16 (SDPA's flash and cuDNN backends, GQA, causal masks).
2. ``throughput`` — ``benchmarks/gpu_throughput.py`` on ``llama-1b``, bf16, seq 2048, one
   process per variant: Hugging Face eager and the recipe each at the largest batch that fits
   (searched), the recipe with per-block compile at the recipe's batch; tokens/s, MFU, peak
   memory, and a profiler kernel table where the recipe is short of the goal (≥ 45% MFU,
   ≥ 1.5× eager).
3. ``explain`` — ``sf.explain`` of each measured configuration (the same model, dtype,
   kernels, batch and sequence; ``--hardware`` by the device: h100, h200 or a100): predicted
   per-rank memory and step time as ratios to the measured peak memory and step time.
4. ``train`` — ``slapo-fn train`` on one device as a data-parallel job of one (torchrun, NCCL
   on a GPU, gloo on CPU; FSDP2 over a one-rank mesh), bf16, with foreach and with fused
   AdamW: each run saves checkpoints, its loss must fall, and a second run resumed from its
   middle checkpoint must start from the same state (its first loss equal bit for bit); whether
   every later loss is bit-identical too (``resume_bit_identical``) depends on the backward
   kernels being deterministic, and is reported.

5. ``levers`` (only when named in ``--parts``: the second call of a loan with time left) —
   ``gpu_throughput.py``'s lever variants at ``recipe_compile``'s batch, each one change
   against it: float8 linears (torchao, sm_89+; refused elsewhere) and the foreach AdamW
   (what the fused one gains); each with its tokens/s over ``recipe_compile``'s.
6. ``cp`` (only when named in ``--parts``) — ``benchmarks/context_parallel_ring.py``: context
   parallelism's ring attention (PyTorch's, ``impl="ring"``) against its all-gather attention
   (``impl="allgather"``) at sequence 32768, bf16, forward + backward on one GPU: milliseconds,
   peak memory, their ratio and the largest difference; the ring reports itself ``skipped``
   without CUDA (the smoke).

Time: the parts share ``--budget-s`` (default 465 s for the default parts, under the 8 minutes the script may
take), each with its own share (``BUDGET_S``); what a part leaves unused goes to the later
ones, and no part may eat the minimum shares of those after it. ``--smoke`` runs every
part on a tiny model on CPU in float32 (the test suite does, so this cannot rot between
GPU loans); ``--quick`` (with ``--smoke``) runs the cheaper subset the default suite runs.

    python benchmarks/gpu_check.py OUT [--smoke [--quick]] [--parts parity,throughput,explain,train]
    python benchmarks/gpu_check.py OUT --parts throughput,levers     # the levers against recipe_compile
    python benchmarks/gpu_check.py OUT --parts cp                    # ring against all-gather attention
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("parity", "throughput", "explain", "train", "levers", "cp")
#: The parts a run without ``--parts`` runs: ``levers`` is the second call of a loan with time left.
DEFAULT_PARTS = ("parity", "throughput", "explain", "train")
#: The variants of ``gpu_throughput.py`` the ``levers`` part runs, one lever each against ``recipe_compile``.
LEVERS = ("recipe_compile_float8", "recipe_compile_foreach")
#: The batch at which the levers part runs its own ``recipe_compile`` baseline and every lever,
#: where the throughput part did not run before it: it fits a 1B LLaMA at seq 2048 on an H100
#: with either lever (27 GiB measured for the foreach AdamW, 2026-11-27).
LEVER_BATCH = 8
#: Seconds each step may take on a GPU (one H100 or H200); the shares add up to the budget.
BUDGET_S = {"header": 25, "parity": 60, "hf_eager": 70, "recipe": 70, "recipe_compile": 110, "explain": 40,
            "train": 90, "recipe_compile_float8": 110, "recipe_compile_foreach": 100, "cp_ring": 120}
#: How far ring and all-gather attention may differ in bf16, relative to each tensor's largest
#: magnitude: 8 roundings of bf16 (2^-8 each).
CP_RELATIVE_TOL = 8 * 2.0**-8
#: Packages the script reports: what the machine should have, and what it may lack.
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "einops", "tqdm", "accelerate", "triton",
            "huggingface_hub", "numpy", "flash_attn", "datasets", "optuna", "tensorboard")
#: The environment variable through which gpu_check.sh names the folder its wheelhouse went to.
WHEELHOUSE_ENV = "SLAPO_FN_WHEELHOUSE_SITE"
#: Seconds a part that ran out of time has to stop after SIGTERM before it is killed.
STOP_GRACE_S = 15.0
#: The figures the script was built to reach (issue 40).
GOALS = {"recipe_mfu": 0.45, "recipe_speedup_vs_hf_eager": 1.5, "explain_memory_ratio_within": 0.10,
         "explain_step_time_ratio_within": 0.25}


class Clock:
    """The shared time budget: each step gets its share, plus what earlier steps left,
    less the shares of the steps still to come. A budget under the shares' sum shrinks every
    share by the same factor, so that no step (the header first of all) is left 5 s.

    >>> clock = Clock(0.5 * sum(BUDGET_S[s] for s in ("header", "cp_ring")), ["header", "cp_ring"])
    >>> round(clock.limit("header")) == BUDGET_S["header"] // 2
    True
    """

    def __init__(self, total_s: float, steps: Sequence[str]) -> None:
        self.deadline = time.monotonic() + total_s
        self.left = list(steps)
        self.scale = min(1.0, total_s / max(1.0, sum(BUDGET_S.get(s, 0) for s in steps)))

    def limit(self, step: str) -> float:
        """Seconds ``step`` may take now (at least 5); it is then no longer to come."""
        if step in self.left:
            self.left.remove(step)
        later = self.scale * sum(BUDGET_S.get(s, 0) for s in self.left)
        return max(5.0, self.deadline - time.monotonic() - later)


def run(cmd: Sequence[str], timeout: float, env: dict[str, str], log: Callable[[str], None]) -> dict[str, Any]:
    """``cmd`` in a session of its own, killed with everything it started when ``timeout``
    runs out: status (ok, failed, timeout), seconds, the last JSON line of its output, and
    the tail of its error output where it did not succeed."""
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        # SIGTERM first: slapo-fn's launcher then stops its job (torchrun's agent and the ranks live in
        # sessions of their own); what is still there after STOP_GRACE_S is killed
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=STOP_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out, err = proc.communicate()
        status = "timeout"
    result: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - start, 1)}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if lines:
        with contextlib.suppress(json.JSONDecodeError):
            result["result"] = json.loads(lines[-1])
    if status != "ok":
        useful = [line for line in err.splitlines() if line.strip() and not line.startswith("USDT:")]
        result["error"] = (f"exit code {proc.returncode}" if status == "failed" else f"killed after {timeout:.0f} s")
        result["stderr_tail"] = useful[-12:]
        log(f"  {' '.join(cmd[1:4])}: {result['error']}")
        for line in useful[-12:]:
            log(f"    {line[:300]}")
    return result


def header() -> dict[str, Any]:
    """The machine, its device and driver, and the Python packages present (``--part header``)."""
    from importlib import metadata

    found: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        found["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            packages[name] = None if importlib.util.find_spec(name) is None else "present (no metadata)"
    found["packages"] = packages
    import torch

    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    found["device"] = "cpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                     multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                     cudnn=torch.backends.cudnn.version())
    import transformers

    found["transformers"] = transformers.__version__
    found["transformers_from"] = str(Path(transformers.__file__).parent.parent)
    import slapo_fn as sf
    from slapo_fn.presets import build_model

    found["slapo_fn_from"] = str(Path(sf.__file__).parent)
    # the stack works, not only imports: a tiny model's step, as Hugging Face runs it and as the recipe does
    torch.manual_seed(0)
    model, ids = build_model("llama-tiny"), torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    built = sf.build(sf.recipes.for_model(model)(sf.create_schedule(model), kernels=True))
    found["tiny_step_loss"] = round(float(built(input_ids=ids, labels=ids).loss.detach()), 4)
    return found


def hardware_of(device: str) -> str:
    """The hardware profile (``slapo_fn/hardware``) of a device name: h100, h200, a100, else cpu."""
    for word, profile in (("H200", "h200"), ("H100", "h100"), ("A100", "a100")):
        if word in device:
            return profile
    return "cpu"


def explain_part(args: argparse.Namespace) -> dict[str, Any]:
    """``sf.explain`` of the measured configurations against their figures (``--part explain``)."""
    import torch

    import slapo_fn as sf
    from slapo_fn.kernels import CHUNKED_LOSS, FULL_LOGITS_LOSS
    from slapo_fn.presets import build_model

    measured = json.loads(args.measured)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    results: dict[str, Any] = {"hardware": args.hardware}
    for variant, figures in measured.items():
        model = build_model(args.model, meta=True).to(dtype)
        sch = sf.create_schedule(model)
        if variant != "hf_eager":
            sch = sf.recipes.for_model(model)(sch, kernels=True, compile=variant == "recipe_compile")
        ids = torch.zeros((figures["batch"], args.seq), dtype=torch.long, device="meta")
        # the losses gpu_throughput.make gives them: the model's own (float32 logits) for
        # hf_eager, the chunked causal_lm_loss for the recipes; AdamW keeps the params' dtype
        loss = FULL_LOGITS_LOSS if variant == "hf_eager" else CHUNKED_LOSS
        info = sf.explain(sch, ids, hardware=args.hardware, loss=loss)
        assert info.memory is not None and info.time is not None
        row = info.memory.rows[0]
        predicted_bytes = info.memory.max_total_bytes
        entry: dict[str, Any] = {
            "batch": figures["batch"],
            "predicted_memory_gib": round(predicted_bytes / 2**30, 2),
            "predicted_parts_gib": {k: round(v / 2**30, 2) for k, v in (
                ("params", row.param_bytes), ("grads", row.grad_bytes), ("optimizer", row.optimizer_bytes),
                ("activations", row.activation_bytes or 0))},
            "predicted_step_s": round(info.time.step_s, 4), "measured_step_s": figures["step_s"],
            "step_time_ratio": round(info.time.step_s / figures["step_s"], 3),
        }
        if figures.get("peak_memory_gib"):
            entry["measured_peak_memory_gib"] = figures["peak_memory_gib"]
            entry["memory_ratio"] = round(predicted_bytes / 2**30 / figures["peak_memory_gib"], 3)
        results[variant] = entry
    assert info.memory is not None
    results["assumptions"] = [
        "memory: params + grads + AdamW's 2 states in the params' dtype + activations ("
        + info.memory.activation_note + ")",
        *info.time.assumptions,
    ]
    return results


def train_part(args: argparse.Namespace, env: dict[str, str], clock: Clock, log: Callable[[str], None]
               ) -> dict[str, Any]:
    """``slapo-fn train`` as a data-parallel job of one, per AdamW implementation: it runs,
    its loss falls, and a run resumed from its middle checkpoint gives the same losses."""
    model, seq, batch, steps = ("llama-tiny", 64, 8, 8) if args.smoke else ("llama-small", 256, 16, 20)
    impls = ("foreach",) if args.quick else ("foreach", "fused")
    resume = not args.quick  # --quick: one run, its loss; the resume is the full smoke's
    middle = steps // 2
    common = ["-m", "slapo_fn.cli", "train", "--model", model, "--dp", "1", "--dp-mode", "fsdp", "--dtype", "bf16",
              "--seq", str(seq), "--batch", str(batch), "--steps", str(steps), "--save-every", str(middle),
              "--no-progress", "--log-every", str(middle)]
    results: dict[str, Any] = {"model": model, "seq": seq, "batch": batch, "steps": steps, "resumed_at": middle,
                               "command": "slapo-fn " + " ".join(common[2:])}
    scratch = Path(tempfile.mkdtemp(prefix="slapo-fn-gpu-check-"))
    runs_left = (2 if resume else 1) * len(impls)
    try:
        for impl in impls:
            first, again = scratch / impl / "first", scratch / impl / "resumed"
            metrics = {first: scratch / f"{impl}-first.jsonl", again: scratch / f"{impl}-resumed.jsonl"}
            cmd = [sys.executable, *common, "--optimizer-impl", impl]
            whole = run([*cmd, "--checkpoint-dir", str(first), "--metrics", str(metrics[first])],
                        clock.limit("train") / runs_left, env, log)
            runs_left -= 1
            entry: dict[str, Any] = {"run": whole}
            results[impl] = entry
            if whole["status"] != "ok" or not resume:
                runs_left -= 1 if resume else 0
                entry.update(_compare_runs(metrics[first], metrics[again], middle))
                continue
            # the second run starts from the middle checkpoint alone
            again.mkdir(parents=True)
            shutil.copytree(first / f"step-{middle:08d}", again / f"step-{middle:08d}")
            (again / "LATEST").write_text(f"step-{middle:08d}\n")
            entry["resumed_run"] = run([*cmd, "--checkpoint-dir", str(again), "--resume", "--metrics",
                                        str(metrics[again])], clock.limit("train") / runs_left, env, log)
            runs_left -= 1
            entry.update(_compare_runs(metrics[first], metrics[again], middle))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def throughput_part(args: argparse.Namespace, out: Path, env: dict[str, str], clock: Clock,
                    log: Callable[[str], None], save: Callable[[], None]) -> dict[str, Any]:
    """``gpu_throughput.py``, one process per variant (a crash or a hang costs one variant;
    ``--quick``: eager and the recipe in one); ``measured`` holds each variant's figures."""
    base = [sys.executable, "benchmarks/gpu_throughput.py", *(["--smoke"] if args.smoke else []), "--model",
            args.model, "--seq", str(args.seq)]
    measured: dict[str, Any] = {}
    part: dict[str, Any] = {"status": "ok", "variants": {}, "measured": measured}
    groups = [["hf_eager", "recipe"]] if args.quick else [["hf_eager"], ["recipe"], ["recipe_compile"]]
    for group in groups:
        extra = ["--batch", "auto"]
        if group == ["recipe_compile"]:  # a new batch recompiles: take the recipe's (or eager's)
            found = measured.get("recipe") or measured.get("hf_eager")
            extra = ["--batch", str(found["batch"])] if found else ["--batch", "auto", "--search-probes", "4"]
        if "hf_eager" in measured:
            extra += ["--eager-tokens-per-s", str(measured["hf_eager"]["tokens_per_s"])]
        if group != ["hf_eager"]:
            extra += ["--profile-out", str(out / f"profile_{group[-1]}.txt")]
        limit = [clock.limit(v) for v in group][-1]
        result = run([*base, "--variants", ",".join(group), *extra], limit, env, log)
        for variant in group:
            figures = result.get("result", {}).get(variant)
            if figures:
                measured[variant] = figures
                log(f"throughput {variant}: batch {figures['batch']}, {figures['tokens_per_s']:,.0f} tokens/s, "
                    f"MFU {figures['mfu']}, step {figures['step_s']} s, peak {figures['peak_memory_gib']} GiB"
                    + (f", {figures['speedup_vs_hf_eager']}x HF eager" if "speedup_vs_hf_eager" in figures else ""))
        part["variants"][",".join(group)] = result
        if result["status"] != "ok":
            part["status"] = "failed"
        save()
    return part


def levers_part(args: argparse.Namespace, out: Path, env: dict[str, str], clock: Clock, measured: dict[str, Any],
                log: Callable[[str], None], save: Callable[[], None]) -> dict[str, Any]:
    """Each lever of :data:`LEVERS` (``gpu_throughput.py``'s variants: float8 linears, the
    foreach AdamW against the fused one), one process each, at ``recipe_compile``'s batch;
    its gain is its tokens/s over ``recipe_compile``'s. Where the throughput part did not
    measure ``recipe_compile`` in this run, this part runs it first at :data:`LEVER_BATCH`,
    so that every lever is compared side by side at one batch. A lever this machine cannot
    run (float8 below sm_89) is ``refused``, with the reason."""
    base = [sys.executable, "benchmarks/gpu_throughput.py", *(["--smoke"] if args.smoke else []), "--model",
            args.model, "--seq", str(args.seq)]
    part: dict[str, Any] = {"status": "ok", "variants": {}}
    found = measured.get("recipe_compile")
    if not found:
        result = run([*base, "--variants", "recipe_compile", "--batch", str(LEVER_BATCH)],
                     clock.limit("recipe_compile"), env, log)
        found = result.get("result", {}).get("recipe_compile", {})
        part["baseline"] = {**result, "result": found}
        if "tokens_per_s" not in found:
            part["status"] = "failed"
            return {**part, "error": "the baseline recipe_compile gave no figures"}
        log(f"levers baseline recipe_compile: batch {found['batch']}, {found['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {found['mfu']}")
    batch = ["--batch", str(found["batch"])]
    for lever in LEVERS:
        result = run([*base, "--variants", lever, *batch], clock.limit(lever), env, log)
        figures = result.get("result", {}).get(lever, {})
        if figures.get("status") == "refused":
            log(f"levers {lever}: refused: {figures.get('error')}")
        elif "tokens_per_s" in figures:
            figures["gain_vs"] = {"recipe_compile": round(figures["tokens_per_s"] / found["tokens_per_s"], 3)}
            log(f"levers {lever}: batch {figures['batch']}, {figures['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {figures['mfu']}" + (f", {figures['gain_vs']['recipe_compile']}x recipe_compile"
                                          if "gain_vs" in figures else ""))
        elif result["status"] == "ok":
            result = {**result, "status": "failed", "error": f"no figures for {lever}"}
        part["variants"][lever] = {**result, "result": figures}
        if result["status"] != "ok":
            part["status"] = "failed"
        save()
    return part


def cp_part(args: argparse.Namespace, env: dict[str, str], clock: Clock, log: Callable[[str], None]) \
        -> dict[str, Any]:
    """``benchmarks/context_parallel_ring.py``: ring against all-gather attention (the ring
    ``skipped`` without CUDA, with the reason); a ring that ran must agree with the
    all-gather attention: the largest difference of any output or input gradient within
    :data:`CP_RELATIVE_TOL` of that tensor's largest magnitude (bf16 rounds to 2^-8 of it; the
    two schemes sum in different orders)."""
    result = run([sys.executable, "benchmarks/context_parallel_ring.py", *(["--smoke"] if args.smoke else [])],
                 clock.limit("cp_ring"), env, log)
    figures = result.get("result", {})
    ring, gathered = figures.get("ring", {}), figures.get("allgather", {})
    if ring.get("status") == "skipped":
        log(f"cp: allgather {gathered.get('ms')} ms; ring skipped: {ring.get('reason')}")
    elif "ring_speedup" in figures:
        log(f"cp seq {figures['seq']}: allgather {gathered['ms']} ms ({gathered.get('peak_gib')} GiB), ring "
            f"{ring['ms']} ms ({ring.get('peak_gib')} GiB): {figures['ring_speedup']}x; "
            f"max diff {figures['max_diff']:.3g} ({figures['max_rel_diff']:.3g} of the magnitude)")
        if figures["max_rel_diff"] > CP_RELATIVE_TOL:
            result = {**result, "status": "failed", "error": f"ring and all-gather differ by {figures['max_diff']}, "
                      f"{figures['max_rel_diff']} of the largest magnitude (more than {CP_RELATIVE_TOL})"}
    elif result["status"] == "ok":
        result = {**result, "status": "failed", "error": "no figures for the ring"}
    return result


def steps_of(wanted: Sequence[str], quick: bool) -> list[str]:
    """The budgeted steps (:data:`BUDGET_S`) of the parts ``wanted``, in the order they run.

    >>> steps_of(["levers"], quick=False)
    ['header', 'recipe_compile', 'recipe_compile_float8', 'recipe_compile_foreach']
    """
    steps = ["header", *(["parity"] if "parity" in wanted else []),
             *(["hf_eager", "recipe"] + ([] if quick else ["recipe_compile"]) if "throughput" in wanted else []),
             *(s for s in ("explain", "train") if s in wanted)]
    if "levers" in wanted:  # the levers' baseline where the throughput part does not measure it
        steps += [*([] if "recipe_compile" in steps else ["recipe_compile"]), *LEVERS]
    return [*steps, *(["cp_ring"] if "cp" in wanted else [])]


def goals_met(parts: dict[str, Any]) -> dict[str, bool | None]:
    """Each goal of :data:`GOALS` against the figures (``None``: no figure for it)."""
    measured = parts.get("throughput", {}).get("measured", {})
    explained = parts.get("explain", {}).get("result", {})
    met: dict[str, bool | None] = {}
    for variant in ("recipe", "recipe_compile"):
        figures = measured.get(variant, {})
        mfu, speedup = figures.get("mfu"), figures.get("speedup_vs_hf_eager")
        met[f"{variant}_mfu"] = None if mfu is None else mfu >= GOALS["recipe_mfu"]
        met[f"{variant}_speedup"] = None if speedup is None else speedup >= GOALS["recipe_speedup_vs_hf_eager"]
        e = explained.get(variant, {})
        memory, step = e.get("memory_ratio"), e.get("step_time_ratio")
        met[f"{variant}_explain_memory"] = (None if memory is None
                                            else abs(memory - 1) <= GOALS["explain_memory_ratio_within"])
        met[f"{variant}_explain_step_time"] = (None if step is None
                                               else abs(step - 1) <= GOALS["explain_step_time_ratio_within"])
    return met


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _compare_runs(first: Path, resumed: Path, middle: int) -> dict[str, Any]:
    """The first run's losses (and where its job ran), and the resumed run's against them."""
    whole, again = _records(first), _records(resumed)
    found: dict[str, Any] = {}
    if whole:
        losses = [r["loss"] for r in whole]
        found.update(first_loss=losses[0], last_loss=losses[-1], loss_falls=losses[-1] < losses[0],
                     ran_on=whole[-1].get("mem_kind"), peak_memory_gib=round(whole[-1].get("peak_mem_bytes", 0)
                                                                             / 2**30, 3))
    later = {r["step"]: r for r in whole if r["step"] > middle}
    pairs = [(later[r["step"]], r) for r in again if r["step"] in later]
    if pairs:
        found["resume_steps_compared"] = len(pairs)
        # the first resumed step's loss is a forward of the restored weights on the restored data position:
        # equal bit for bit whatever the kernels; later steps also need a deterministic backward
        found["resume_first_step_identical"] = pairs[0][0]["loss"] == pairs[0][1]["loss"]
        found["resume_bit_identical"] = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
                                            for a, b in pairs)
        found["resume_max_loss_diff"] = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
        if found["resume_first_step_identical"] and not found["resume_bit_identical"]:
            found["note"] = ("the resumed run starts from the identical state (its first loss is equal) and drifts "
                             "later: a backward kernel that is not deterministic (e.g. attention's atomics), "
                             "not the resume")
    return found


def _train_problems(result: dict[str, Any]) -> list[str]:
    """What the training part did not show, per AdamW implementation (none: it passed)."""
    problems = []
    for impl in ("foreach", "fused"):
        r = result.get(impl)
        if r is None:
            continue
        for name in ("run", "resumed_run"):
            if name in r and r[name]["status"] != "ok":
                problems.append(f"{impl}: the {name.replace('_', ' ')} {r[name]['status']}")
        if r["run"]["status"] == "ok" and not r.get("loss_falls"):
            problems.append(f"{impl}: the loss did not fall")
        if r.get("resumed_run", {}).get("status") == "ok" and not r.get("resume_first_step_identical"):
            problems.append(f"{impl}: the resumed run's first loss differs from the uninterrupted run's "
                            f"(the losses by up to {r.get('resume_max_loss_diff')})")
    return problems if any(k in result for k in ("foreach", "fused")) else ["no training run"]


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    path = [str(ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if not args.smoke:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _without_wheelhouse(env: dict[str, str]) -> dict[str, str]:
    site = env.get(WHEELHOUSE_ENV)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    return {**{k: v for k, v in env.items() if k != WHEELHOUSE_ENV}, "PYTHONPATH": os.pathsep.join(kept)}


def drive(args: argparse.Namespace) -> int:
    """Every part in order; the JSON after each. Returns 0 when every part that ran succeeded."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"script": "benchmarks/gpu_check.sh", "smoke": args.smoke, "goals": GOALS,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": {}}
    parts: dict[str, Any] = report["parts"]
    json_path = out / "gpu_check.json"

    def save() -> None:
        tmp = json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, json_path)

    def log(line: str) -> None:
        print(line, flush=True)

    wanted = [p for p in args.parts.split(",") if p]
    clock = Clock(args.budget_s, steps_of(wanted, args.quick))
    env = _env(args)
    py = sys.executable
    smoke = ["--smoke"] if args.smoke else []

    # 0. header: what the machine is; a wheelhouse that breaks imports is dropped
    head = run([py, __file__, "--part", "header"], clock.limit("header"), env, log)
    if head["status"] != "ok" and env.get(WHEELHOUSE_ENV):
        log("header: failed with the wheelhouse on PYTHONPATH; again with the machine's packages only")
        env = _without_wheelhouse(env)
        head = run([py, __file__, "--part", "header"], clock.limit("header"), env, log)
        head["wheelhouse_dropped"] = True
    report["header"] = head.pop("result", {})
    parts["header"] = head
    info = report["header"]
    log(f"device: {info.get('device')}; {info.get('nvidia_smi', 'no nvidia-smi')}; torch {info.get('torch')} "
        f"(CUDA {info.get('cuda')}); transformers {info.get('transformers')} from {info.get('transformers_from')}")
    log("packages: " + ", ".join(f"{k} {v}" if v else f"{k} absent" for k, v in info.get("packages", {}).items()))
    save()
    hardware = args.hardware or hardware_of(str(info.get("device", "cpu")))

    if "parity" in wanted:
        parts["parity"] = run([py, "benchmarks/gpu_parity.py", *smoke], clock.limit("parity"), env, log)
        parity = parts["parity"].get("result", {})
        log(f"parity: ok={parity.get('ok')} " + ", ".join(f"{k} {v.get('status')}"
                                                          for k, v in parity.get("checks", {}).items()))
        save()

    measured: dict[str, Any] = {}
    if "throughput" in wanted:
        parts["throughput"] = throughput_part(args, out, env, clock, log, save)
        measured = parts["throughput"]["measured"]

    if "explain" in wanted:
        if measured:
            parts["explain"] = run([py, __file__, "--part", "explain", *smoke, "--model", args.model, "--seq",
                                    str(args.seq), "--hardware", hardware, "--measured", json.dumps(measured)],
                                   clock.limit("explain"), env, log)
            for variant, e in parts["explain"].get("result", {}).items():
                if isinstance(e, dict) and "step_time_ratio" in e:
                    log(f"explain {variant} ({hardware}): memory {e.get('memory_ratio', 'n/a')}x measured, step time "
                        f"{e['step_time_ratio']}x measured")
        else:
            parts["explain"] = {"status": "skipped", "error": "no throughput figures to explain"}
        save()

    if "train" in wanted:
        start = time.monotonic()
        try:
            result = train_part(args, env, clock, log)
            problems = _train_problems(result)
            parts["train"] = {"status": "failed" if problems else "ok", "seconds": round(time.monotonic() - start, 1),
                              "result": result, **({"error": "; ".join(problems)} if problems else {})}
            for impl in ("foreach", "fused"):
                r = result.get(impl, {})
                if r:
                    log(f"train {impl}: loss {r.get('first_loss')} -> {r.get('last_loss')} on {r.get('ran_on')}; "
                        f"resume bit-identical: {r.get('resume_bit_identical')}")
        except Exception as e:  # the JSON still gets written
            parts["train"] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        save()

    if "levers" in wanted:
        parts["levers"] = levers_part(args, out, env, clock, measured, log, save)

    if "cp" in wanted:
        parts["cp"] = cp_part(args, env, clock, log)
        save()

    report["goals_met"] = goals_met(parts)
    report["seconds"] = round(args.budget_s - (clock.deadline - time.monotonic()), 1)
    report["ok"] = all(p.get("status") == "ok" for p in parts.values())
    save()
    log(f"wrote {json_path} in {report['seconds']} s: " + ", ".join(f"{k} {v.get('status')}" for k, v in parts.items()))
    return 0 if report["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=None, help="folder for gpu_check.json, the log and the profiles")
    parser.add_argument("--smoke", action="store_true", help="every part on a tiny model on CPU: checks the script")
    parser.add_argument("--quick", action="store_true",
                        help="with --smoke: no compile variant; one training run (foreach), no resume")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all but levers)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for everything (default 465; "
                        "--smoke: 600)")
    parser.add_argument("--model", default=None, help="the throughput model (default llama-1b; --smoke: llama-tiny)")
    parser.add_argument("--seq", type=int, default=None, help="the throughput sequence (default 2048; --smoke: 32)")
    parser.add_argument("--hardware", default=None, help="explain's profile (default: by the device's name)")
    parser.add_argument("--part", default=None, choices=("header", "explain"), help=argparse.SUPPRESS)
    parser.add_argument("--measured", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or ("llama-tiny" if args.smoke else "llama-1b")
    args.seq = args.seq or (32 if args.smoke else 2048)
    steps = steps_of([p for p in args.parts.split(",") if p], args.quick)
    args.budget_s = args.budget_s or (600.0 if args.smoke else float(sum(BUDGET_S[s] for s in steps)))
    if args.part == "header":
        print(json.dumps(header()), flush=True)
        return 0
    if args.part == "explain":
        print(json.dumps(explain_part(args)), flush=True)
        return 0
    if args.out is None:
        parser.error("OUT (the folder for the figures) is required")
    unknown = [p for p in args.parts.split(",") if p and p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}: use {', '.join(PARTS)}")
    return drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
