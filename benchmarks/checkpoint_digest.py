"""The cost of verified checkpoints: the digests next to the save and the load.

Saves a LLaMA-shaped model with AdamW state (one process, CPU) with ``sf.save`` —
which writes the DCP files, hashes them (xxh3-128) and writes the manifest — and
measures, each as a median of ``--repeats``:

* ``save_s``: the whole save; ``digest_s``: hashing the saved files alone
  (``checkpoint_dir.digests``, what the save spends on them); ``digest_share``: their
  ratio;
* ``load_s``: ``sf.load`` (which verifies first) and ``verify_s``: the verification
  alone (``checkpoint_dir.manifest_problems``); ``digest_gb_s``: hashing throughput.

Target (issue 38): the digest a small share of the save (under 10%).

    .venv/bin/python benchmarks/checkpoint_digest.py [--hidden 1024 --layers 8 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_fn as sf
from slapo_fn.checkpoint_dir import MANIFEST, digests, manifest_problems
from slapo_fn.train import adamw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256, vocab_size=32000)
    model = LlamaForCausalLM(cfg)
    opt = adamw(model, lr=1e-4)
    model(torch.randint(0, 32000, (1, 8)), labels=torch.randint(0, 32000, (1, 8))).loss.backward()
    opt.step()  # AdamW state exists: a checkpoint of model and optimizer, as training saves it
    saves, hashes, loads, verifies = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for step in range(args.repeats):
            began = time.perf_counter()
            saved = sf.save(model, opt, folder, step=step, keep=1)
            saves.append(time.perf_counter() - began)
            names = sorted(f.name for f in saved.iterdir() if f.name != MANIFEST)
            began = time.perf_counter()
            digests(saved, names)
            hashes.append(time.perf_counter() - began)
            began = time.perf_counter()
            assert not manifest_problems(saved)
            verifies.append(time.perf_counter() - began)
            began = time.perf_counter()
            sf.load(model, opt, folder)
            loads.append(time.perf_counter() - began)
        size = sum(f.stat().st_size for f in saved.iterdir())
    save_s, digest_s = statistics.median(saves), statistics.median(hashes)
    print(json.dumps({
        "benchmark": "checkpoint_digest", "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": size, "save_s": round(save_s, 3), "digest_s": round(digest_s, 3),
        "digest_share": round(digest_s / save_s, 3), "load_s": round(statistics.median(loads), 3),
        "verify_s": round(statistics.median(verifies), 3), "digest_gb_s": round(size / digest_s / 1e9, 2),
    }))


if __name__ == "__main__":
    main()
