"""The stage breakdown's arithmetic on a hand-made trace (the GPU run makes the real one)."""
import pytest

from tailorkv.engine.bench.stages import stage_of, summarize


def test_stage_names():
    assert stage_of("gather_rows_w16") == stage_of("gather_long_rows_w16") == stage_of("refresh_rows_kernel") == "pcie gather"
    assert stage_of("qk_quant_b1_d128") == "1/2-bit attention"
    assert stage_of("sketch_scores_kernel") == "sketch scores"
    assert stage_of("sm90_xmma_gemm_bf16bf16") == "dense (gemm/gemv)"
    assert stage_of("attend_decode_partial") == "attention"
    assert stage_of("rms_norm_bf16") == "fused norm/rope/silu"
    assert stage_of("page_scores") == stage_of("page_slots") == stage_of("bound_page") == "selection"  # quest's
    assert stage_of("void at::native::vectorized_elementwise_kernel") .startswith("other")


def test_summary_of_two_streams():
    k = lambda name, ts, dur, stream: {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}  # noqa: E731
    trace = {"traceEvents": [
        k("sm90_gemm", 0, 100, 7), k("attend_decode", 100, 50, 7), k("rms_norm", 300, 10, 7),
        k("gather_rows_w16", 50, 200, 13),                                       # copy stream: 100 us overlapped
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 400, "dur": 40, "args": {"stream": 13}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]}
    s = summarize(trace, steps=2, wall_ms=1.0)
    assert s["kernels_per_step"] == 2.0                       # 4 kernels over 2 steps (copies are not kernels)
    assert abs(s["gpu_busy_ms"] - (250 + 10 + 40) / 1e3 / 2) < 1e-9
    assert s["stage_ms"]["pcie gather"] == 0.1 and s["stage_ms"]["pcie copy d2h"] == 0.02
    busy = s["stream_busy_ms"]  # per step: stream 7's kernels 150 + 10 us, stream 13's gather 200 + copy 40 us
    assert set(busy) == {"7", "13"} and busy["7"] == pytest.approx(0.08) and busy["13"] == pytest.approx(0.12)
    split = s["stage_stream_ms"]  # stream 7 runs the most kernels: the compute stream (13 is the busier)
    assert split["pcie gather"] == {"compute": 0.0, "side": 0.1} and split["pcie copy d2h"]["side"] == 0.02
    assert split["attention"] == {"compute": 0.025, "side": 0.0}
    assert abs(s["other_streams_overlapped_ms"] - 0.1 / 2) < 1e-9
    assert abs(s["concurrent_ms"] - (400 - 300) / 1e3 / 2) < 1e-9  # 400 us of intervals in a 300 us union


def test_prefill_flops_of_llama_3_1_8b():
    from tailorkv.engine.bench.driver import prefill_flops
    from tailorkv.models.config import ModelConfig
    cfg = ModelConfig(name="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                      vocab_size=128256, norm_eps=1e-5, rope_theta=5e5, max_context=131072)
    one = prefill_flops(cfg, 1)
    # 6.98e9 projection weights (8.03e9 less the two 0.53e9 embedding tables), plus the last token's logits
    assert abs(one["dense (gemm/gemv)"] - 2 * (6.98e9 + 0.525e9)) / one["dense (gemm/gemv)"] < 0.01
    n = 131072
    f = prefill_flops(cfg, n, batch=2)
    assert abs(f["attention"] - 2 * 4 * 32 * 32 * 128 * n * (n + 1) / 2) < 1
    logits = 2 * 4096 * 128256
    assert f["dense (gemm/gemv)"] == 2 * (n * (one["dense (gemm/gemv)"] - logits) + logits)


def test_prefill_stage_table_shows_tflops():
    from rich.console import Console
    from tailorkv.engine.bench.command import prefill_stage_table
    cell = {"method": "full", "ctx": 131072, "prompt_tokens": 131000,
            "prefill_stages": {"kernels_per_step": 9000, "gpu_busy_ms": 11000.0, "wall_ms": 11200.0,
                               "stage_ms": {"attention": 6500.0, "dense (gemm/gemv)": 3000.0, "other": 100.0},
                               "flops": {"attention": 4.5e15, "dense (gemm/gemv)": 1.95e15}}}
    con = Console(width=300, record=True)
    con.print(prefill_stage_table(cell))
    text = " ".join(con.export_text().split())   # the title wraps at the table's width
    assert "692" in text and "650" in text and "11.20 s" in text   # 4.5e15 / 6.5 s, 1.95e15 / 3.0 s


@pytest.mark.parametrize("split", [True, False])
def test_decode_stage_table_splits_stages_by_stream(split):
    """Each stage's time on the compute stream and on the side streams, where a side stream ran anything (and a
    bench.json written before the split still prints)."""
    from rich.console import Console
    from tailorkv.engine.bench.command import stage_table
    st = {"kernels_per_step": 1031, "gpu_busy_ms": 16.36, "concurrent_ms": 11.33, "cuda_graph": True,
          "stage_ms": {"pcie gather": 10.452, "attention": 6.571}}
    if split:
        st["stage_stream_ms"] = {"pcie gather": {"compute": 1.25, "side": 9.202},
                                 "attention": {"compute": 6.571, "side": 0.0}}
    con = Console(width=300, record=True)
    con.print(stage_table({"method": "tailorkv", "ctx": 131072, "decode_ms": {"median": 16.38}, "stages": st}))
    text = con.export_text()
    assert ("side streams" in text and "9.202" in text and "1.250" in text) == split
    assert "10.452" in text and "16.38 ms/step" in " ".join(text.split())


@pytest.mark.parametrize("streams", [2, 32])
def test_decode_stage_table_drops_the_split_where_a_graph_ran_on_the_drivers_streams(streams):
    """A graph replay that ran its branches on more streams than the engine's three (the H100's 8k cell: one
    per layer) gets no per-stream columns, which would name the driver's streams compute / side, but a caption."""
    from rich.console import Console
    from tailorkv.engine.bench.command import stage_table
    st = {"kernels_per_step": 938, "gpu_busy_ms": 9.39, "concurrent_ms": 3.02, "cuda_graph": True,
          "stage_ms": {"dense (gemm/gemv)": 5.339, "attention": 2.538},
          "stage_stream_ms": {"dense (gemm/gemv)": {"compute": 0.492, "side": 4.847},
                              "attention": {"compute": 2.538, "side": 0.0}},
          "stream_busy_ms": {str(7 + i): 0.18 for i in range(streams)}}
    con = Console(width=300, record=True)
    con.print(stage_table({"method": "tailorkv", "ctx": 8192, "decode_ms": {"median": 9.56}, "stages": st}))
    text = " ".join(con.export_text().split())
    assert ("side streams" in text and "4.847" in text) == (streams == 2)
    assert ("spread its branches over 32 streams" in text) == (streams == 32)
    assert "5.339" in text
