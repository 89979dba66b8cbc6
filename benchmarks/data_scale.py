"""Data at the size people pre-train on (issue 44): a generated corpus of ``--gb`` GB
(JSON lines of the Python standard library's sources, sampled with replacement), then

(a) ``prepare``'s throughput against the tokenizer library's own batch encoder on the same
    cores (its ceiling: ``tokenizers.Tokenizer.encode_batch_fast`` on all cores, on texts
    already in memory, over the first ``--ceiling-mb`` of the corpus), measured before and
    after ``prepare``, side by side; both in MB/s of JSON lines (and in MB per CPU-second,
    which other jobs on a shared machine disturb less than wall time), and ``prepare``'s peak
    memory (the parent and its workers together, sampled from ``/proc``), also on a
    corpus 100x smaller (the same peak says it is bounded, not grown with the corpus);
(b) ``slapo-fn train`` on the prepared folder: seconds from launch to the line of step 1
    (beside the same run on the synthetic task: the part that is not the data's), and
    the largest rank's peak resident memory, against a prepared folder 100x smaller (the
    same per-rank memory says it does not grow with the corpus);
(c) ``slapo-fn train --stream`` on the corpus: seconds from launch to step 1.

Prints one JSON line (the corpus and its prepared folder are kept in ``--work``)::

    .venv/bin/python benchmarks/data_scale.py [--gb 2] [--work /tmp/slapo-data-scale] [--dp 2] [--no-stream]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

FILE_BYTES = 64 << 20
VOCAB = 8192


def _corpus(folder: Path, gb: float) -> list[Path]:
    """JSON-lines files of about 64 MiB, ``gb`` GB in all (made once, kept)."""
    from slapo_fn.data import stdlib_corpus

    done = folder.with_name(folder.name + ".done")
    if done.is_file() and done.read_text() == str(gb):
        return sorted(folder.glob("*.jsonl"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    docs = [json.dumps({"text": d}) + "\n" for d in stdlib_corpus(max_bytes=None)]
    rng = random.Random(0)
    target, written, index = int(gb * 1e9), 0, 0
    while written < target:
        with open(folder / f"part-{index:05d}.jsonl", "w") as f:
            size = 0
            while size < FILE_BYTES and written + size < target:
                line = rng.choice(docs)
                f.write(line)
                size += len(line.encode())
        written += size
        index += 1
    done.write_text(str(gb))
    return sorted(folder.glob("*.jsonl"))


def _tokenizer(folder: Path) -> Path:
    from slapo_fn.data import stdlib_corpus, train_bpe

    if not (folder / "tokenizer.json").is_file():
        train_bpe(stdlib_corpus(max_bytes=8_000_000), vocab_size=VOCAB, save_to=folder)
    return folder


class _PeakRss:
    """The peak memory of a process tree, sampled from /proc every 50 ms: of all its
    processes together (proportional set sizes, so that pages a forked worker shares with
    its parent count once) and the largest resident set of one process."""

    def __init__(self, root: int) -> None:
        self.root, self.total, self.largest, self.seen = root, 0, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    @staticmethod
    def _sizes(pid: int) -> tuple[int, int]:
        """(Rss, Pss) of ``pid`` in bytes; zeros once it is gone."""
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                          if ":" in line and not line.startswith(("0", "f")))
            return int(fields["Rss"].split()[0]) * 1024, int(fields["Pss"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return 0, 0

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            sizes = [self._sizes(pid) for pid in self._tree()]
            self.seen.update(self._tree())
            self.total = max(self.total, sum(p for _, p in sizes))
            self.largest = max([self.largest, *(r for r, _ in sizes)])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"all_mb": self.total / 2**20, "largest_mb": self.largest / 2**20, "processes": len(self.seen)}


def _run(command: list[str], *, until: str | None = None, timeout: float = 3600) -> dict[str, Any]:
    """Run ``command``; the seconds until a stdout line starts with ``until`` (then stop
    it), or until it ends; and the peak memory of its process tree."""
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    peak = _PeakRss(proc.pid)
    seen, lines = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if until is not None and line.startswith(until):
            seen = time.perf_counter() - began
            break
        if time.perf_counter() - began > timeout:
            break
    if seen is not None:
        time.sleep(0.3)  # a last sample of the ranks after step 1
        os.killpg(proc.pid, 15)
    _, status, usage = os.wait4(proc.pid, 0)  # its CPU time, and its reaped workers'
    proc.returncode = os.waitstatus_to_exitcode(status)
    memory = peak.stop()
    if until is not None and seen is None:
        raise RuntimeError(f"{' '.join(command)} did not reach {until!r}:\n{''.join(lines)[-2000:]}"
                           f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
    if until is None and proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr.read()[-3000:] if proc.stderr else ''}")
    return {"seconds": seen if seen is not None else time.perf_counter() - began,
            "cpu_s": usage.ru_utime + usage.ru_stime, **memory}


def _ceiling(files: list[Path], tokenizer: Path, mb: float) -> tuple[float, float]:
    """MB/s of JSON lines that ``encode_batch_fast`` encodes on all cores (texts in memory),
    in a fresh process; and MB per CPU-second (its threads' CPU time)."""
    code = f"""
import json, time, sys
from tokenizers import Tokenizer
files, budget = {[str(f) for f in files]!r}, {int(mb * 1e6)}
texts, size = [], 0
for name in files:
    for line in open(name, "rb"):
        texts.append(json.loads(line)["text"]); size += len(line)
        if size >= budget: break
    if size >= budget: break
tok = Tokenizer.from_file({str(tokenizer / "tokenizer.json")!r})
began, cpu = time.perf_counter(), time.process_time()
for i in range(0, len(texts), 1000):
    tok.encode_batch_fast(texts[i:i + 1000], add_special_tokens=False)
print(size / (time.perf_counter() - began) / 1e6, size / (time.process_time() - cpu) / 1e6)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall, per_cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(per_cpu)


def _model(folder: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                tie_word_embeddings=False).save_pretrained(folder)
    return folder / "config.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/slapo-data-scale"))
    parser.add_argument("--workers", type=int, default=None, help="prepare's workers (default: one per CPU)")
    parser.add_argument("--ceiling-mb", type=float, default=128.0)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--no-stream", action="store_true", help="skip (c) (a machine without `datasets`)")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "slapo_fn.cli"]
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    files = _corpus(work / "corpus", args.gb)
    tokenizer = _tokenizer(work / "tokenizer")
    size = sum(f.stat().st_size for f in files)
    setup_s = time.perf_counter() - began

    before = _ceiling(files, tokenizer, args.ceiling_mb)
    shutil.rmtree(work / "prepared", ignore_errors=True)
    workers = ["--workers", str(args.workers)] if args.workers else []
    prepared = _run([*cli, "prepare", "--data", str(work / "corpus"), "--tokenizer", str(tokenizer), "--out",
                     str(work / "prepared"), "--no-progress", *workers])
    after = _ceiling(files, tokenizer, args.ceiling_mb)
    prepare_mb_s = size / prepared["seconds"] / 1e6
    manifest = json.loads((work / "prepared" / "manifest.json").read_text())

    small = work / "prepared-small"  # 1/100 of the corpus, for per-rank memory against the corpus's size
    (work / "small").mkdir(exist_ok=True)
    with open(files[0], "rb") as src, open(work / "small" / "part.jsonl", "wb") as dst:
        dst.write(src.read(size // 100))
        dst.write(src.readline())  # to the end of the line
    shutil.rmtree(small, ignore_errors=True)
    prepared_small = _run([*cli, "prepare", "--data", str(work / "small"), "--tokenizer", str(tokenizer), "--out",
                           str(small), "--no-progress", *workers])
    model = _model(work / "model")
    train = [*cli, "train", "--model", str(model), "--dp", str(args.dp), "--steps", "2", "--batch",
             str(4 * args.dp), "--seq", "512", "--log-every", "1", "--no-progress"]
    synthetic = _run(train, until="step 1 ")  # the same run without data: what is not the data's
    on_map = _run([*train, "--data", str(work / "prepared")], until="step 1 ")  # the folder's own tokenizer
    on_small = _run([*train, "--data", str(small)], until="step 1 ")
    streamed = None if args.no_stream else _run(
        [*train, "--data", str(work / "corpus"), "--stream", "--tokenizer", str(tokenizer)], until="step 1 ")
    mean_ceiling = (before[0] + after[0]) / 2
    mean_ceiling_cpu = (before[1] + after[1]) / 2
    prepare_mb_cpu_s = size / prepared["cpu_s"] / 1e6
    result = {
        "benchmark": "data_scale", "corpus_gb": round(size / 1e9, 3), "files": len(files),
        "cpus": len(os.sched_getaffinity(0)), "tokenizer": f"byte-level BPE, {VOCAB} tokens",
        "tokens": manifest["tokens"], "documents": manifest["documents"], "setup_s": round(setup_s, 1),
        "prepare_mb_s": round(prepare_mb_s, 2), "prepare_s": round(prepared["seconds"], 1),
        "encode_ceiling_mb_s": [round(before[0], 2), round(after[0], 2)],
        "prepare_vs_ceiling": round(prepare_mb_s / mean_ceiling, 3),
        "per_cpu_second": {"prepare_mb": round(prepare_mb_cpu_s, 3),
                           "encode_ceiling_mb": [round(before[1], 3), round(after[1], 3)],
                           "prepare_vs_ceiling": round(prepare_mb_cpu_s / mean_ceiling_cpu, 3)},
        "prepare_peak_mb": {"all_processes_pss": round(prepared["all_mb"]),
                            "largest_process_rss": round(prepared["largest_mb"]), "processes": prepared["processes"],
                            "corpus_over_100_all_processes_pss": round(prepared_small["all_mb"])},
        "train_synthetic_step1_s": round(synthetic["seconds"], 1),
        "train_prepared_step1_s": round(on_map["seconds"], 1),
        "train_rank_peak_rss_mb": {"corpus": round(on_map["largest_mb"]),
                                   "corpus_over_100": round(on_small["largest_mb"])},
        "train_stream_step1_s": None if streamed is None else round(streamed["seconds"], 1),
        "dp": args.dp,
        "targets": {"prepare_vs_ceiling": ">= 0.8", "train_prepared_step1_s": "< 15",
                    "train_stream_step1_s": "< 20", "rank_rss": "independent of the corpus's size"},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
