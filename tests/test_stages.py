"""The stage breakdown's arithmetic on a hand-made trace (the GPU run makes the real one)."""
from tailorkv.engine.bench.stages import stage_of, summarize


def test_stage_names():
    assert stage_of("gather_rows_w16") == "pcie gather"
    assert stage_of("qk_quant_b1_d128") == "1/2-bit attention"
    assert stage_of("sm90_xmma_gemm_bf16bf16") == "dense (gemm/gemv)"
    assert stage_of("attend_decode_partial") == "attention"
    assert stage_of("rms_norm_bf16") == "fused norm/rope/silu"
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
    assert list(s["stream_busy_ms"]) == ["13", "7"] or list(s["stream_busy_ms"]) == ["7", "13"]
    assert abs(s["other_streams_overlapped_ms"] - 0.1 / 2) < 1e-9
    assert abs(s["concurrent_ms"] - (400 - 300) / 1e3 / 2) < 1e-9  # 400 us of intervals in a 300 us union
