"""The GPU script (benchmarks/gpu_check.sh, issue 40) on CPU: every part on a tiny model, so
that it cannot rot between GPU loans; its verdicts are checked on made-up figures too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke(out: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out), "--smoke", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=560, env=dict(os.environ, PYTHON=sys.executable))
    figures = json.loads((out / "gpu_check.json").read_text())
    return result, figures


@pytest.mark.timeout(300)
def test_the_quick_smoke_runs_every_part_and_writes_the_figures(tmp_path: Path) -> None:
    result, figures = _smoke(tmp_path, "--quick")
    assert result.returncode == 0, result.stdout[-4000:]
    assert figures["ok"], json.dumps(figures["parts"])[:4000]
    log = (tmp_path / "gpu_check.log").read_text().splitlines()
    assert log[0].startswith("gpu_check:") and log[1].startswith("nvidia-smi:")
    assert any(line.startswith("device: cpu;") and "torch " in line for line in log[:6]), log[:6]
    assert any(line.startswith("packages:") and "flash_attn absent" in line for line in log[:6]), log[:6]
    parts = figures["parts"]
    assert parts["parity"]["result"]["ok"] and parts["parity"]["result"]["checks"]["model"]["status"] == "pass"
    measured = parts["throughput"]["measured"]
    eager, recipe = measured["hf_eager"], measured["recipe"]
    assert eager["batch"] == recipe["batch"] == 4  # the smoke's --max-batch, found by the search
    assert [(p["batch"], p["fits"]) for p in eager["batch_search"]] == [(1, True), (2, True), (4, True)]
    assert recipe["first_loss"] == pytest.approx(eager["first_loss"], abs=1e-3)  # same weights, same batch
    assert recipe["speedup_vs_hf_eager"] > 0 and recipe["mfu"] > 0
    assert (tmp_path / recipe["profile"]["table"]).is_file()  # on CPU the recipe is short of the GPU goal
    explained = parts["explain"]["result"]
    assert explained["hardware"] == "cpu" and explained["recipe"]["step_time_ratio"] > 0
    train = parts["train"]["result"]["foreach"]
    assert train["ran_on"] == "cpu" and train["loss_falls"], train


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_full_smoke_compiles_and_resumes_bit_identically_with_both_adamws(tmp_path: Path) -> None:
    result, figures = _smoke(tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    throughput = figures["parts"]["throughput"]
    assert set(throughput["variants"]) == {"hf_eager", "recipe", "recipe_compile"}  # one process each
    assert throughput["measured"]["recipe_compile"]["tokens_per_s"] > 0
    for impl in ("foreach", "fused"):
        train = figures["parts"]["train"]["result"][impl]
        assert train["resume_bit_identical"] and train["resume_steps_compared"] == 4, train  # CPU: deterministic


def test_a_broken_kernel_fails_parity_and_a_faithful_one_passes() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from slapo_fn.kernels import RMSNorm

    parity = _load("gpu_parity")
    x = {"x": torch.randn(2, 5, 16)}

    def check(kernel: object) -> str:
        return parity.module_check(LlamaRMSNorm(16), kernel, x, lambda m, i: m(i["x"]), torch.float64,
                                   torch.float32)["status"]

    def off_by_eps(old: torch.nn.Module) -> torch.nn.Module:
        return RMSNorm(old.weight, eps=1e-2)

    assert check(RMSNorm.from_hf) == "pass"
    assert check(off_by_eps) == "FAIL"


def test_the_train_verdict_names_what_did_not_hold() -> None:
    check = _load("gpu_check")
    ok = {"status": "ok"}
    good = {"run": ok, "resumed_run": ok, "loss_falls": True, "resume_bit_identical": True}
    good["resume_first_step_identical"] = True
    assert check._train_problems({"foreach": good, "fused": good}) == []
    drifts = {**good, "resume_first_step_identical": True, "resume_bit_identical": False}
    assert check._train_problems({"foreach": good | {"resume_first_step_identical": True}, "fused": drifts}) == []
    differs = {**good, "resume_first_step_identical": False, "resume_max_loss_diff": 3e-7}
    assert check._train_problems({"fused": differs}) == [
        "fused: the resumed run's first loss differs from the uninterrupted run's (the losses by up to 3e-07)"]
    hung = {"run": {"status": "timeout"}}
    assert check._train_problems({"foreach": hung}) == ["foreach: the run timeout"]
    assert check._train_problems({}) == ["no training run"]


def test_resumed_losses_are_compared_step_by_step(tmp_path: Path) -> None:
    check = _load("gpu_check")
    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows = [{"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0, "mem_kind": "cuda", "peak_mem_bytes": 2**30}
            for s in range(1, 9)]
    first.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again.write_text("".join(json.dumps({**r, "loss": r["loss"] + (1e-9 if r["step"] == 7 else 0)}) + "\n"
                             for r in rows[4:]))
    found = check._compare_runs(first, again, 4)
    assert found["loss_falls"] and found["ran_on"] == "cuda" and found["resume_steps_compared"] == 4
    assert found["resume_first_step_identical"] and not found["resume_bit_identical"]
    assert found["resume_max_loss_diff"] == pytest.approx(1e-9) and "not deterministic" in found["note"]


def test_the_parts_share_the_budget_and_keep_the_later_ones_shares() -> None:
    check = _load("gpu_check")
    clock = check.Clock(300.0, ["parity", "train"])
    assert clock.limit("parity") == pytest.approx(300.0 - check.BUDGET_S["train"], abs=0.5)
    assert clock.limit("train") == pytest.approx(300.0, abs=0.5)  # the last part gets what is left
    assert check.hardware_of("NVIDIA H100 80GB HBM3") == "h100" and check.hardware_of("NVIDIA H200") == "h200"


def _broken_wheel(folder: Path) -> None:
    """A transformers wheel that cannot be imported, as a wheelhouse that does not fit the machine."""
    import base64
    import hashlib
    import zipfile

    name = "transformers-9.9.9"
    files = {"transformers/__init__.py": "raise ImportError('this transformers does not fit the machine')\n",
             f"{name}.dist-info/METADATA": "Metadata-Version: 2.1\nName: transformers\nVersion: 9.9.9\n",
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}

    def digest(text: str) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{k},{digest(v)},{len(v.encode())}\n" for k, v in files.items()) + f"{name}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as wheel:
        for path, text in {**files, f"{name}.dist-info/RECORD": record}.items():
            wheel.writestr(path, text)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_wheelhouse_that_breaks_imports_is_dropped_for_the_machines_packages(tmp_path: Path) -> None:
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    _broken_wheel(wheels)
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out), "--parts", ""], cwd=ROOT,
                            capture_output=True, text=True, timeout=170,
                            env=dict(os.environ, PYTHON=sys.executable, SLAPO_FN_WHEELHOUSE=str(wheels)))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "wheelhouse: transformers-9.9.9-py3-none-any.whl" in result.stdout
    figures = json.loads((out / "gpu_check.json").read_text())
    assert figures["parts"]["header"] == {**figures["parts"]["header"], "status": "ok", "wheelhouse_dropped": True}
    assert figures["header"]["transformers"] != "9.9.9"


def test_the_levers_run_only_when_named_and_the_default_budget_is_the_default_parts() -> None:
    check = _load("gpu_check")
    assert "levers" not in check.DEFAULT_PARTS and "levers" in check.PARTS
    default = check.steps_of(check.DEFAULT_PARTS, quick=False)
    assert sum(check.BUDGET_S[s] for s in default) == 465  # what a loan's first call takes
    assert check.steps_of(["throughput", "levers"], quick=False)[-2:] == list(check.LEVERS)
    # alone, the levers measure their own baseline first, at one batch with them
    assert check.steps_of(["levers"], quick=False) == ["header", "recipe_compile", *check.LEVERS]
    assert check.steps_of(["throughput", "levers"], quick=True)[-3:] == ["recipe_compile", *check.LEVERS]


def test_a_budget_under_the_shares_shrinks_each_share_instead_of_starving_the_first() -> None:
    """A second call of a loan with `--budget-s 330` for throughput, levers and cp once gave
    the header 5 s (it was killed, and every part after it ran without its figures)."""
    check = _load("gpu_check")
    steps = check.steps_of(["throughput", "levers", "cp"], quick=False)
    clock = check.Clock(330, steps)
    share = 330 / sum(check.BUDGET_S[s] for s in steps)
    assert abs(clock.limit("header") - share * check.BUDGET_S["header"]) < 1
    roomy = check.Clock(10_000, steps)  # above the shares' sum: the first step gets what the others leave
    assert roomy.limit("header") > 10_000 - sum(check.BUDGET_S[s] for s in steps)


@pytest.mark.timeout(240)
def test_float8_is_refused_by_name_where_the_hardware_cannot_run_it(tmp_path: Path) -> None:
    """On this CPU the float8 lever is a refusal in the figures, with the reason, not a crash."""
    result = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--smoke", "--variants",
                             "recipe_compile_float8", "--batch", "1"], cwd=ROOT, capture_output=True, text=True,
                            timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])["recipe_compile_float8"]
    assert figures["status"] == "refused" and "float8" in figures["error"], figures


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_levers_part_measures_foreach_and_says_why_float8_is_refused(tmp_path: Path) -> None:
    result, figures = _smoke(tmp_path, "--parts", "levers")
    levers = figures["parts"]["levers"]["variants"]
    assert levers["recipe_compile_float8"]["result"]["status"] == "refused", levers
    assert levers["recipe_compile_foreach"]["result"]["tokens_per_s"] > 0, levers
    # without the throughput part, its own baseline at the levers' batch, and the gain over it
    baseline = figures["parts"]["levers"]["baseline"]["result"]
    assert baseline["batch"] == levers["recipe_compile_foreach"]["result"]["batch"], figures["parts"]["levers"]
    assert levers["recipe_compile_foreach"]["result"]["gain_vs"]["recipe_compile"] > 0
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.mark.timeout(120)
def test_the_ring_benchmark_times_the_allgather_attention_and_says_why_the_ring_is_skipped_on_cpu() -> None:
    """benchmarks/context_parallel_ring.py --smoke: the all-gather attention timed; PyTorch's
    ring attention, CUDA's, reported as skipped with the schedule's reason."""
    result = subprocess.run([sys.executable, "benchmarks/context_parallel_ring.py", "--smoke"], cwd=ROOT,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["allgather"]["status"] == "ok" and figures["allgather"]["ms"] > 0, figures
    if not torch.cuda.is_available():
        assert figures["ring"]["status"] == "skipped" and "no ring strategy" in figures["ring"]["reason"], figures


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cp_part_runs_only_when_named_and_smokes_on_cpu(tmp_path: Path) -> None:
    check = _load("gpu_check")
    assert "cp" in check.PARTS and "cp" not in check.DEFAULT_PARTS
    assert check.steps_of(["cp"], quick=False) == ["header", "cp_ring"]
    result, figures = _smoke(tmp_path, "--parts", "cp")
    assert result.returncode == 0, result.stdout[-4000:]
    cp = figures["parts"]["cp"]
    assert cp["status"] == "ok" and cp["result"]["allgather"]["ms"] > 0, cp
    assert "cp: allgather" in (tmp_path / "gpu_check.log").read_text()
