"""Time one sparse read (forward + backward) through the torch read paths on this machine.

    python scripts/bench_read_paths.py [--batch 4] [--tokens 512] [--heads 9] [--entries 384] [--window-only]

One segment shaped like a CSA2 full layer's latent read in training: ``--tokens`` queries and store
rows, ``--entries`` selected per query (Top-K + window), a shared 208-wide key and 144-wide value.
``--window-only``: each query reads only its last ``--entries`` positions (a sliding layer's prefill,
e.g. ``--tokens 4096 --entries 512``), where ``auto`` reads each 512-query block's stretch of the store.
Prints the median of ``--repeats`` runs per path; run it alone (the timing is the machine's).
"""

import argparse
import statistics
import time

import torch

from hf_csa2.model.sparse_attention import SparseSegment, sparse_sink_attention, window_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--entries", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window-only", action="store_true", help="each query reads its last --entries positions")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    b, t, h, n = args.batch, args.tokens, args.heads, args.entries
    q = torch.randn(b, t, h, 208, generator=g, requires_grad=True)
    k = torch.randn(b, t, 1, 208, generator=g, requires_grad=True)
    v = torch.randn(b, t, 1, 144, generator=g, requires_grad=True)
    if args.window_only:
        index = window_index(torch.arange(t), n)[None].expand(b, t, n)
    else:
        index = torch.randint(0, t, (b, t, n), generator=g)
        index = torch.where(index <= torch.arange(t)[None, :, None], index, -1)  # causal; -1 = no entry
    for path in ("gather", "scores", "auto"):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out, _ = sparse_sink_attention([SparseSegment(q, k, v, index)], scaling=0.1, path=path)
            out[0].sum().backward()
            times.append(time.perf_counter() - start)
        print(f"{path}: {statistics.median(times):.2f} s forward + backward (median of {args.repeats})")


if __name__ == "__main__":
    main()
