"""The near-duplicate search of data/duplicates.pairs_within: time and peak memory at 100k and 1M 64-bit hashes.

Random 64-bit hashes (uniform bits, as a well-spread pHash set) with 100 planted copies that differ from their
original in 0 to 4 bits; each case searches for the pairs within 4 bits, in a process of its own (so that its peak
resident memory, VmHWM, is its own), and checks that every planted pair is found. "self" is one set against
itself (each pair once: half the distances), "A x B" two sets. Peak RSS: the process's peak resident memory
during the search (torch imported, the hashes made: 64 bytes per hash as bool); extra: that peak over the resident
memory just before the search.

    python benchmarks/duplicate_search.py [--cases 100k,100kx100k,1Mx100k,1M] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line

PLANTED = 100
THRESHOLD = 4
SIZES = {"100k": 100_000, "1M": 1_000_000}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="100k,100kx100k,1Mx100k,1M",
                        help="comma-separated: N (self) or NxM (two sets), optionally /BLOCK")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steady on a shared machine; 2 slow down whenever a core is taken)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this case, print JSON
    return parser.parse_args()


def vm_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS now, VmHWM the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def hashes(n: int, seed: int):
    """n random 64-bit hashes as [n, 64] bool."""
    import torch

    return torch.randint(0, 2, (n, 64), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).bool()


def run_case(case: str, device: str, threads: int) -> dict:
    """Search one case in this process: seconds, peak and extra memory, pairs found, planted pairs found."""
    import torch

    torch.set_num_threads(threads)
    from data.duplicates import BLOCK, pairs_within

    sizes, _, block = case.partition("/")
    n, _, m = sizes.partition("x")
    a = hashes(SIZES[n], 0)
    b = hashes(SIZES[m], 1) if m else None
    target = a if b is None else b
    rows = torch.arange(PLANTED) * (len(a) // PLANTED)
    cols = torch.arange(PLANTED) * (len(target) // PLANTED) + (1 if b is None else 0)
    target[cols] = a[rows]
    flips = torch.arange(PLANTED) % (THRESHOLD + 1)  # 0..4 bits flipped
    for col, k in zip(cols.tolist(), flips.tolist()):
        target[col, :k] ^= True
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS: the search's own peak
    before = vm_kb("VmRSS")
    start = time.perf_counter()
    found_rows, found_cols, _ = pairs_within(a, b, THRESHOLD, block=int(block or BLOCK), device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    found = set(zip(found_rows.tolist(), found_cols.tolist()))
    compared = len(a) * (len(a) - 1) // 2 if b is None else len(a) * len(b)
    return {"case": case, "seconds": seconds, "compared": compared, "peak_mb": vm_kb("VmHWM") / 1024,
            "extra_mb": (vm_kb("VmHWM") - before) / 1024, "found": len(found),
            "planted": sum((r, c) in found for r, c in zip(rows.tolist(), cols.tolist())),
            "block": int(block or BLOCK), "threads": torch.get_num_threads()}


def main() -> None:
    args = parse_args()
    if args.one:
        print(json.dumps(run_case(args.one, args.device, args.threads)))
        return
    print(machine_line(), file=sys.stderr)
    print(f"\n#### pairs_within, 64-bit hashes, threshold {THRESHOLD}, {args.device}, {args.threads} thread(s)\n")
    print("| case | block | pairs compared | seconds | ns per pair | peak RSS MB | extra MB | pairs found | planted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in args.cases.split(","):
        print(f"running {case}, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
        out = subprocess.run([sys.executable, __file__, "--one", case, "--device", args.device,
                              "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        name = case.split("/")[0].replace("x", " x ") + ("" if "x" in case else " self")
        print(f"| {name} | {r['block']} | {r['compared']:.2e} | {r['seconds']:.1f} | "
              f"{r['seconds'] / r['compared'] * 1e9:.2f} | {r['peak_mb']:.0f} | {r['extra_mb']:.0f} | {r['found']} | "
              f"{r['planted']}/{PLANTED} |", flush=True)


if __name__ == "__main__":
    main()
