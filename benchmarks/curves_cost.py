"""The Curves hook's cost (issue 48): curves.png drawn after each epoch of a finished run, as training draws it.

    python train.py --config digits output_dir=runs/digits && python benchmarks/curves_cost.py runs/digits

In one process, draw_curves runs on the first 1, 2, ... N rows of the run's metrics.jsonl (the hook's N calls;
the first pays matplotlib's import, as in a training process), timed with perf_counter; the sum is compared
with the sum of the epochs' epoch_time_s (less than the run's wall time, so the share is not understated). docs/benchmarks.md holds the measured figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.logs import MetricsFile  # noqa: E402
from engine.curves import draw_curves  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    rows = MetricsFile(parser.parse_args().run_dir / "metrics.jsonl").rows()
    times = []
    with tempfile.TemporaryDirectory() as folder:
        for n in range(1, len(rows) + 1):
            start = time.perf_counter()
            draw_curves(rows[:n], Path(folder) / "curves.png", "val_top1")
            times.append(time.perf_counter() - start)
    trained = sum(row["epoch_time_s"] for row in rows)
    print(f"{len(rows)} calls: first {times[0]:.3f} s, then median {sorted(times[1:])[len(times[1:]) // 2]:.3f} s, "
          f"total {sum(times):.2f} s = {100 * sum(times) / trained:.2f}% of the epochs' {trained:.0f} s")


if __name__ == "__main__":
    main()
