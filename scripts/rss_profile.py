"""Where a conversion's resident memory builds up: runs ``convert`` in this process with a
thread that reads VmRSS every 50 ms and prints each new high (in steps of --step MB) with the
hf_csa2 frames of the main thread's stack at that moment.

    python scripts/rss_profile.py /tmp/llama-1b --plan PLAN.yaml [--step 50]

(``scripts/measure_memory.py llama-1b --keep /tmp/llama-1b`` builds that source; this script
measures the process from inside, so its figures sit a little below ``/usr/bin/time``'s.)
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import threading
import time
import traceback


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(entry for entry in status if entry.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


def watch(main_thread: int, step: float) -> None:
    high = 0
    while True:
        rss = resident_bytes()
        if rss > high + step:
            frames = traceback.extract_stack(sys._current_frames().get(main_thread))
            ours = [f"{f.filename.split('/hf_csa2/')[-1]}:{f.lineno} {f.name}" for f in frames
                    if "/hf_csa2/" in f.filename and ".venv" not in f.filename][-5:]
            high = rss
            print(f"{time.strftime('%X')} high {rss / 1e9:.3f} GB at {' <- '.join(reversed(ours))}", flush=True)
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--step", type=float, default=50, help="MB between two printed highs")
    args = parser.parse_args()
    from hf_csa2.surgery.pipeline import convert

    threading.Thread(target=watch, args=(threading.get_ident(), args.step * 1e6), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        convert(args.source, args.plan, out_dir=f"{tmp}/out", log=lambda m: print(m[:200], flush=True))
    print(f"peak (ru_maxrss) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.3f} GB")


if __name__ == "__main__":
    main()
