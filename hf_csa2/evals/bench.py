"""Side-by-side cost benchmark (seed 002 §5: prefill, time to first token, decode speed,
peak memory, KV cache), original vs converted in ONE process.

Measurements are interleaved -- for each repeat, each length, each model in turn -- so a
noisy neighbour slows every model alike, and medians over repeats are reported with the
ratio of each model to the first. Same dtype, batch, prompt tokens and output length for all.

Per (model, length, repeat):
  * ``prefill_s``: one forward over the prompt [batch, length] with a fresh cache;
  * ``ttft_s``: prefill plus picking the first token (greedy);
  * ``decode_ms_per_token``: mean over ``new_tokens`` single-token steps with the cache;
  * ``peak_rss_mb``: the process's peak resident memory during the measurement (Linux: the
    high-water mark is reset through /proc/self/clear_refs before each one), plus
    ``peak_gpu_mb`` on CUDA;
  * ``kv_bytes``: bytes held by the live cache object after prefill + decode.

Per row also the decode step's lower bound (:mod:`hf_csa2.metrics.decode_bound`): the bytes it
must read (weights once, what attention must read from the cache, at the middle decode step's
context), the time that takes at the read bandwidth measured in the same process, and the
measured step's fraction of it (1.0 = as fast as memory allows).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..errors import InputError
from ..metrics.decode_bound import decode_read_bytes, measure_read_bandwidth
from ..metrics.kv_cache import live_cache_bytes, live_cache_elements

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM (peak RSS) of this process
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@torch.no_grad()
def measure_once(model, length: int, *, new_tokens: int = 16, batch: int = 1, seed: int = 0) -> dict:
    """One measurement of ``model`` at prompt ``length`` (see the module doc for the fields)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    rss_reset = _reset_peak_rss()

    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    cache = out.cache
    for _ in range(new_tokens):
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        cache = out.cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    if cuda:
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    result = {
        "prefill_s": t1 - t0,
        "ttft_s": t2 - t0,
        "decode_ms_per_token": 1000 * (t3 - t2) / max(new_tokens, 1),
        "peak_rss_mb": _peak_rss_mb() if rss_reset else None,
        "kv_bytes": live_cache_bytes(cache),
        "kv_elements": live_cache_elements(cache),
        "cached_tokens": length + new_tokens,
    }
    if cuda:
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return result


def bench(models: list[tuple[str, object]], lengths: list[int], *, new_tokens: int = 16, repeats: int = 3,
          batch: int = 1, warmup: bool = True, log=None) -> list[dict]:
    """Interleaved measurements; returns one row per (length, model) with medians and ratios.

    Args:
        models: ``(name, model)`` pairs, all resident (interleaving needs them together).
        lengths: prompt lengths in tokens.
    """
    dtypes = {str(next(m.parameters()).dtype) for _, m in models}
    if len(dtypes) > 1:
        raise InputError(f"models have different dtypes {sorted(dtypes)}; compare like with like")
    dtype = dtypes.pop()
    if warmup:  # first calls pay one-off costs (allocator, kernel selection)
        for _, model in models:
            measure_once(model, min(lengths), new_tokens=2, batch=batch)
    device = next(models[0][1].parameters()).device
    bandwidth = measure_read_bandwidth(device=device)
    if log:
        log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (sum over a 64 MiB buffer, median of 5)")
    raw: dict[tuple[int, str], list[dict]] = {}
    for r in range(repeats):
        for length in lengths:
            for name, model in models:
                m = measure_once(model, length, new_tokens=new_tokens, batch=batch, seed=r)
                raw.setdefault((length, name), []).append(m)
                if log:
                    log(f"repeat {r} length {length} {name}: prefill {m['prefill_s']:.3f}s "
                        f"decode {m['decode_ms_per_token']:.1f} ms/token")
    rows = []
    model_of = dict(models)
    for length in lengths:
        first = None
        for name, _ in models:
            runs = raw[(length, name)]
            row = {"model": name, "length": length, "batch": batch, "new_tokens": new_tokens, "repeats": repeats,
                   "dtype": dtype}
            for key in runs[0]:
                values = [x[key] for x in runs if x[key] is not None]
                row[key] = statistics.median(values) if values else None
            row["kv_bytes_per_token"] = row["kv_bytes"] / (batch * row["cached_tokens"])
            row["read_bandwidth_gbps"] = bandwidth / 1e9
            row["decode_read_bytes"] = decode_read_bytes(model_of[name], length + (new_tokens + 1) // 2, batch)
            row["decode_bound_ms"] = 1000 * row["decode_read_bytes"] / bandwidth
            row["decode_bound_fraction"] = row["decode_bound_ms"] / row["decode_ms_per_token"]
            row["runs"] = runs
            first = first or row
            for key in ("prefill_s", "ttft_s", "decode_ms_per_token", "peak_rss_mb", "kv_bytes"):
                if row.get(key) is not None and first.get(key):
                    row[f"{key}_ratio"] = row[key] / first[key]
            rows.append(row)
    return rows


def format_bench_table(rows: list[dict]) -> str:
    """Markdown: one line per (length, model), medians and ratios to the first model; the decode
    read bound in ms at the measured bandwidth (MB read) and the measured step's share of it."""
    lines = ["| length | model | prefill s | TTFT s | decode ms/token | read bound ms (MB) | of bound | peak RSS MB | "
             "KV MB | prefill ratio | decode ratio | KV ratio |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for r in rows:
        bound = "n/a" if r.get("decode_bound_ms") is None else f"{r['decode_bound_ms']:.1f} ({r['decode_read_bytes'] / 1e6:.0f})"
        lines.append(
            f"| {r['length']} | {r['model']} | {f(r['prefill_s'], '.3f')} | {f(r['ttft_s'], '.3f')} | "
            f"{f(r['decode_ms_per_token'], '.1f')} | {bound} | {f(r.get('decode_bound_fraction'), '.0%')} | "
            f"{f(r['peak_rss_mb'], '.0f')} | {r['kv_bytes'] / 2**20:.2f} | "
            f"{f(r.get('prefill_s_ratio'), '.3f')} | {f(r.get('decode_ms_per_token_ratio'), '.3f')} | "
            f"{f(r.get('kv_bytes_ratio'), '.3f')} |"
        )
    return "\n".join(lines)


__all__ = ["bench", "format_bench_table", "measure_once"]
