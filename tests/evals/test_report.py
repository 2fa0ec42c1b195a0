"""`hf-csa2 eval report` on tiny models: one markdown with ppl, needle tables, heatmaps, cost."""

from tiny_models import save_tiny_source

from hf_csa2.cli import main as cli_main

from .test_needle import haystack


def test_report(tmp_path):
    save_tiny_source("llama", tmp_path / "orig", max_position_embeddings=4096)
    save_tiny_source("llama", tmp_path / "conv", seed=1, max_position_embeddings=4096)
    (tmp_path / "text.txt").write_text(haystack())
    code = cli_main(["eval", "report", str(tmp_path / "orig"), str(tmp_path / "conv"), "--out", str(tmp_path / "rep"),
                     "--text", str(tmp_path / "text.txt"), "--window", "64", "--max-windows", "2",
                     "--needle-lengths", "1500", "--needle-depths", "0.5", "--per-cell", "1",
                     "--bench-lengths", "32"])
    assert code == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    for heading in ("Held-out perplexity", "Memory capabilities", "Cost"):
        assert heading in report
    assert report.count("![heatmap_") == 2 * 6
    assert (tmp_path / "rep" / "needle" / "needle.json").exists() and (tmp_path / "rep" / "bench.json").exists()
    assert f"Reproduce: `hf-csa2 eval report {tmp_path / 'orig'} {tmp_path / 'conv'} --out" in report
