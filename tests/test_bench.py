"""`tailorkv bench` on CPU with a tiny random HF checkpoint: the JSON schema, the PNGs, clean errors, OOM cells."""
import json
import math
import os

import click
import pytest
import torch
from click.testing import CliRunner

from tailorkv.engine import ui
from tailorkv.engine.bench import driver as B
from tailorkv.engine.bench.command import register
from tailorkv.engine.results import percentile
from tailorkv.engine.settings import METHODS
from helpers import assert_one_line_error, check_png, load_json_strict as load, write_tiny_folder

FAST = ["--decode-steps", "4", "--warmup", "1", "--device", "cpu", "--dtype", "fp32",
        "--budget", "48", "--sink", "8", "--recent", "16", "--channels", "4", "--quant-layers", "0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")  # head_dim 32: room for the 1-bit layer's 32 channels per word
    write_tiny_folder(folder, n_layers=2, hidden=128, n_heads=4, n_kv=2, head_dim=32, max_pos=2048)
    return str(folder)


def bench_cmd(*args):
    @click.group()
    def group():
        pass
    register(group)
    return CliRunner().invoke(group, ["bench", *args])


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def nonneg(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def check_schema(res, methods, ctxs):
    assert res["schema"] == 1 and res["command"].startswith("tailorkv")
    assert {"date", "git_commit", "git_dirty", "torch", "cuda", "gpu", "driver", "cpu_count", "device"} <= set(res["env"])
    assert res["env"]["git_commit"] and res["env"]["cpu_count"] >= 1
    m = res["model"]
    assert positive(m["model_bytes"]) and positive(m["weight_read_bytes"]) and positive(m["kv_bytes_per_token"])
    b = res["bench"]
    assert b["methods"] == methods and b["ctxs"] == ctxs and b["decode_steps"] == 4 and b["warmup"] == 1
    assert positive(b["hbm_gbps"]) and positive(b["pcie_gbps"]) and "gpu_mem_limit_bytes" in b
    for name in ("hbm_gbps", "pcie_gbps"):  # a CPU measures neither: the H200's figures, and it says so
        assert b[f"{name}_source"] in ("flag", "measured", "H200 default")
        assert (b[f"{name}_measured"] is None) == (res["env"]["device"] == "cpu")
    assert set(res["method_settings"]) == set(methods)
    assert [(c["method"], c["ctx"]) for c in res["cells"]] == [(mm, c) for c in ctxs for mm in methods]
    for c in res["cells"]:
        assert c["status"] in ("ok", "oom", "error")
        if c["status"] != "ok":
            assert c["error"]
            continue
        assert positive(c["prefill_s"]) and positive(c["prefill_tok_s"]) and positive(c["tok_s"])
        d = c["decode_ms"]
        assert all(positive(d[k]) for k in ("median", "p90", "mean", "min", "max", "wall_mean"))
        assert d["min"] <= d["median"] <= d["p90"] <= d["max"] and d["steps"] == 4
        assert nonneg(c["kv_device_bytes"]) and nonneg(c["kv_host_bytes"]) and positive(c["host_rss_bytes"])
        assert nonneg(c["pcie_bytes_per_token"]) and positive(c["achieved_gbps"])
        assert c["peak_device_bytes"] is None and c["peak_reserved_prefill_bytes"] is None  # CPU run
        assert c["decode_reference_calls"] == {}  # a CPU run picks no kernel, so none hands a call back
        assert isinstance(c["stats"], dict) and all(nonneg(v) for v in c["stats"].values())
        f = c["floor"]
        assert positive(f["floor_ms"]) and positive(f["fraction"]) and positive(f["weight_bytes"])
        assert f["floor_ms"] == max(f["hbm_ms"], f["pcie_ms"])
        assert c["tokens_held"] == c["prompt_tokens"] + 1 + 4


def test_sweep_writes_json_and_plots(tiny, tmp_path):
    out = tmp_path / "out"
    methods = list(METHODS)
    r = bench_cmd("--model", tiny, "--ctx", "128,256", "--methods", ",".join(methods), "--out", str(out), *FAST)
    assert r.exit_code == 0, r.output
    res = load(out / "bench.json")
    check_schema(res, methods, [128, 256])
    tkv = res["method_settings"]["tailorkv"]  # the layers as resolved, not left to a profile file that may change
    assert tkv["quant_layers"] == [0] and isinstance(tkv["own_query_layers"], list)
    assert res["args"]["sketch_bits"] == 2 and res["args"]["kt_bits"] == 16 and res["args"]["bits"] is None  # numbers
    assert all(c["status"] == "ok" for c in res["cells"]), [c["error"] for c in res["cells"]]
    full = [c for c in res["cells"] if c["method"] == "full"]
    assert full[0]["kv_device_bytes"] > 0 and full[0]["kv_host_bytes"] == 0
    check_png(out / "decode_ms.png")
    check_png(out / "peak_memory.png")
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]  # atomic writes leave nothing behind
    assert "full" in r.output and "cells ok" in r.output


def test_the_channel_row_cache_shrinks_only_the_k_transposed_bytes(tiny, tmp_path):
    """With --kt-cache the cell records the K^T rows read of those chosen, and its PCIe bytes fall
    by the K^T rows not read again (the K/V rows of the chosen tokens are read as before)."""
    args = ["--model", tiny, "--ctx", "512", "--methods", "tailorkv", *FAST]
    assert bench_cmd(*args, "--out", str(tmp_path / "plain")).exit_code == 0
    r = bench_cmd(*args, "--kt-cache", "--out", str(tmp_path / "held"))
    assert r.exit_code == 0, r.output
    plain, held = (load(tmp_path / d / "bench.json")["cells"][0] for d in ("plain", "held"))
    assert plain["row_cache"] is None
    rc, kt = held["row_cache"], held["stats"]["kt_bytes"]
    assert 0 < rc["rows_read"] < rc["rows_chosen"] and kt == plain["stats"]["kt_bytes"] > 0
    assert held["stats"]["bytes_fetched"] == pytest.approx(plain["stats"]["bytes_fetched"] - kt * (1 - rc["read_share"]))


def test_an_earlier_run_is_replaced_only_with_overwrite(tiny, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench.json").write_text('{"earlier": true}')
    args = ["--model", tiny, "--methods", "full", "--ctx", "128", "--out", str(out), *FAST[:8]]
    r = bench_cmd(*args)
    assert_one_line_error(r, "already holds an earlier run's results: pass --overwrite")
    assert " parameters, " not in r.output  # refused before the model loads
    assert (out / "bench.json").read_text() == '{"earlier": true}'
    r = bench_cmd(*args, "--overwrite")
    assert r.exit_code == 0, r.output
    res = load(out / "bench.json")
    assert res["complete"] is True and [c["ctx"] for c in res["cells"]] == [128]


def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(tiny, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    r = bench_cmd("--model", tiny, "--methods", "full", "--out", str(a_file / "sub"), *FAST[:8])
    assert_one_line_error(r, "a_file is a file, not a folder: choose another path")
    r = bench_cmd("--model", tiny, "--methods", "full", "--out", str(a_file), *FAST[:8])
    assert_one_line_error(r, "a_file is a file: give a folder")  # ours, exit 1 (was click's, exit 2)
    r = bench_cmd("--model", tiny, "--methods", "full", "--out", "", *FAST[:8])
    assert_one_line_error(r, "--out is empty")
    assert " parameters, " not in r.output


def test_the_default_folder_is_made_before_the_model_loads(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench").write_text("a file where bench/results/ would go")
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", "128", *FAST[:8])
    assert_one_line_error(r, "cannot make the results folder bench/results/", "or pass --out DIR")
    assert " parameters, " not in r.output


def test_a_folder_where_a_result_file_goes_is_refused_before_the_model_loads(tiny, tmp_path):
    (tmp_path / "b" / "decode_ms.png").mkdir(parents=True)
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", "128", "--out", str(tmp_path / "b"), *FAST[:8])
    assert_one_line_error(r, "decode_ms.png is a folder, and this run writes a file there")
    assert " parameters, " not in r.output and not (tmp_path / "b" / "bench.json").exists()


@pytest.mark.parametrize("ctxs", [",", " , ", ""])
def test_an_empty_ctx_list_is_an_error_not_the_default_sweep(tiny, tmp_path, ctxs):
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", ctxs, "--out", str(tmp_path / "b"), *FAST[:8])
    assert_one_line_error(r, "names no context length")
    assert " parameters, " not in r.output


def test_one_context_written_two_ways_is_one_cell_and_batch_steps_say_so(tiny, tmp_path):
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", "1k,1024,0.5k", "--batch", "2",
                  "--out", str(tmp_path / "b"), *FAST[:8])
    assert r.exit_code == 0, r.output
    res = load(tmp_path / "b" / "bench.json")
    assert res["bench"]["ctxs"] == [1024, 512] and [c["ctx"] for c in res["cells"]] == [1024, 512]
    cell = res["cells"][0]
    assert cell["tok_s"] == pytest.approx(2e3 / cell["decode_ms"]["median"])  # a step decodes a token per sequence
    assert "ms/step of 2 tokens" in r.output


def test_ctrl_c_keeps_the_finished_cells_and_their_plots(tiny, tmp_path, monkeypatch):
    real = B.run_sweep

    def sweep(loaded, plan, on_cell, on_phase):
        def first_cell_then_ctrl_c(cell):
            on_cell(cell)
            raise KeyboardInterrupt
        return real(loaded, plan, on_cell=first_cell_then_ctrl_c, on_phase=on_phase)

    monkeypatch.setattr(B, "run_sweep", sweep)
    out = tmp_path / "b"
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", "128,256", "--out", str(out), *FAST[:8])
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: interrupted: the 1 finished cell of 2 is in ") and "--overwrite" in last
    res = load(out / "bench.json")
    assert res["complete"] is False and [c["ctx"] for c in res["cells"]] == [128]
    check_png(out / "decode_ms.png")
    out2 = tmp_path / "c"  # -o: the finished cells reach stdout too, marked incomplete
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", "128,256", "--out", str(out2), *FAST[:8], "-o", "json")
    assert r.exit_code == 130, r.output
    got = json.loads(r.stdout)
    assert got["complete"] is False and [c["ctx"] for c in got["cells"]] == [128]


def test_ctrl_c_before_any_cell_writes_nothing_and_shows_no_empty_table(tiny, tmp_path, monkeypatch):
    def sweep(loaded, plan, on_cell, on_phase):
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "run_sweep", sweep)
    out = tmp_path / "b"
    r = bench_cmd("--model", tiny, "--methods", "full", "--ctx", "128", "--out", str(out), *FAST[:8])
    assert r.exit_code == 130 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: interrupted: no cell had finished, nothing was written")
    assert "KV offloaded" not in r.output  # the table's headers alone are not shown
    assert not (out / "bench.json").exists()


def test_unknown_method_is_a_clean_error(tiny, tmp_path):
    r = bench_cmd("--model", tiny, "--ctx", "128", "--methods", "full,magic", "--out", str(tmp_path), *FAST)
    assert r.exit_code == 1
    assert "unknown method 'magic'" in r.output and "Traceback" not in r.output
    assert not os.path.exists(tmp_path / "bench.json")


@pytest.mark.parametrize("args, needles", [
    (["--hbm-gbps", "0"], ["--hbm-gbps must be a bandwidth above 0 GB/s", "--hbm-gbps 4300"]),
    (["--pcie-gbps", "nan"], ["--pcie-gbps must be a bandwidth above 0 GB/s, got nan", "--pcie-gbps 55"]),
    (["--batch", "0"], ["--batch must be at least 1, got 0"]),
    (["--decode-steps", "0"], ["--decode-steps must be at least 1, got 0"]),
    (["--warmup", "-1"], ["--warmup must be at least 0, got -1"]),
    (["--gpu-mem-limit", "0"], ["--gpu-mem-limit '0' is not a size"]),
    (["--batch", "10000000"], ["--batch 10000000 at --ctx", "for one layer's prefill alone, more than this machine's "
                               "RAM", "lower --batch or --ctx"]),
])
def test_bad_bench_values_are_one_line_before_loading(tiny, tmp_path, args, needles):
    r = bench_cmd("--model", tiny, "--methods", "full", "--out", str(tmp_path / "b"), *args)
    assert_one_line_error(r, *needles)
    assert " parameters, " not in r.output and not (tmp_path / "b").exists()


def test_bad_sizes_are_clean_errors(tiny, tmp_path):
    r = bench_cmd("--model", tiny, "--ctx", "64", "--decode-steps", "60", "--quant-layers", "0", "--out", str(tmp_path))
    assert r.exit_code == 1 and "no room for a prompt" in r.output
    r = bench_cmd("--model", tiny, "--ctx", "8k", "--methods", "full", "--out", str(tmp_path), *FAST[:6])
    assert r.exit_code == 1 and "beyond what the model supports" in r.output
    r = bench_cmd("--model", tiny, "--gpu-mem-limit", "lots", "--out", str(tmp_path), *FAST)
    assert r.exit_code == 1 and "not a size" in r.output


def test_oom_cell_is_reported_and_the_sweep_goes_on(tiny, tmp_path, monkeypatch):
    real = B.build_cache

    def build(loaded, settings, max_len, batch=1):
        if settings.method == "streamingllm":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        if settings.method == "snapkv":
            raise ModuleNotFoundError("No module named 'tailorkv.engine.policies.snapkv'")
        return real(loaded, settings, max_len, batch)

    monkeypatch.setattr(B, "build_cache", build)
    monkeypatch.chdir(tmp_path)  # default --out: bench/results/<date>-<model>/
    methods = ["streamingllm", "snapkv", "full"]
    r = bench_cmd("--model", tiny, "--ctx", "128,192", "--methods", ",".join(methods), *FAST[:6], "--budget", "48",
                  "--sink", "8")
    assert r.exit_code == 0, r.output
    (folder,) = os.listdir(tmp_path / "bench" / "results")
    assert folder.endswith(os.path.basename(tiny))
    res = load(tmp_path / "bench" / "results" / folder / "bench.json")
    check_schema(res, methods, [128, 192])
    status = {(c["method"], c["ctx"]): c["status"] for c in res["cells"]}
    assert status == {("streamingllm", 128): "oom", ("streamingllm", 192): "oom", ("snapkv", 128): "error",
                      ("snapkv", 192): "error", ("full", 128): "ok", ("full", 192): "ok"}
    snap = next(c for c in res["cells"] if c["method"] == "snapkv")
    assert "tailorkv.engine.policies.snapkv" in snap["error"] and "traceback" in snap
    assert "OOM" in r.output
    check_png(tmp_path / "bench" / "results" / folder / "decode_ms.png")
    r = bench_cmd("--model", tiny, "--ctx", "128", "--methods", "streamingllm,snapkv", *FAST[:6], "--budget", "48",
                  "--sink", "8", "--out", str(tmp_path / "failed"))
    assert r.exit_code == 1, r.output  # a sweep of failures is not a measurement: a script must see it
    assert "error: every cell failed (2 cells: ERROR, OOM; details in " in r.output and "see each cause above" in r.output
    assert load(tmp_path / "failed" / "bench.json")["cells"][0]["status"] == "oom"


def test_helpers():
    assert ui.parse_bytes("24GiB") == 24 << 30 and ui.parse_bytes("24G") == 24 << 30
    assert ui.parse_bytes("24GB") == 24 * 10 ** 9 and ui.parse_bytes("512MiB") == 512 << 20
    assert ui.parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        ui.parse_bytes("24 apples")
    assert B.is_oom(torch.cuda.OutOfMemoryError("x")) and B.is_oom(RuntimeError("CUDA out of memory"))
    assert not B.is_oom(RuntimeError("shape mismatch")) and not B.is_oom(ValueError("out of memory"))
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert B.pcie_bytes({"bytes_fetched": 10, "bytes_copied": 5, "tokens_fetched": 99, "h2d_bytes": 1}) == 16
    plan = B.BenchPlan(ctxs=[1024], methods=["full"], hbm_gbps=1000, pcie_gbps=10)
    cell = {"stats": {"bytes_fetched": 1e7}, "kv_device_bytes": 1e9, "decode_ms": {"median": 4.0}}
    f = B.floor_of(cell, 1e9, 1000, plan)
    assert f["hbm_ms"] == pytest.approx(2.0) and f["pcie_ms"] == pytest.approx(1.0)
    assert f["floor_ms"] == pytest.approx(2.0) and f["fraction"] == pytest.approx(0.5)
    assert f["kv_read_source"] == "device_bytes"
    cell["stats"]["tokens_attended"] = 5e5  # what the policy attended over, not all it holds
    f = B.floor_of(cell, 1e9, 1000, plan)
    assert f["hbm_ms"] == pytest.approx(1.5) and f["kv_read_source"] == "tokens_attended"
    cell["stats"]["kv_read_bytes"] = 0  # a policy that says what it reads on the device wins
    assert B.floor_of(cell, 1e9, 1000, plan)["hbm_ms"] == pytest.approx(1.0)


def test_floor_bandwidths_take_a_flag_then_the_measured_copy_then_the_h200s():
    both = B.floor_bandwidths(None, None, 2988.0, 54.1)
    assert (both["hbm_gbps"], both["hbm_gbps_source"], both["pcie_gbps"], both["pcie_gbps_source"]) == \
        (2988.0, "measured", 54.1, "measured")
    flag = B.floor_bandwidths(4300.0, None, 2988.0, None)
    assert (flag["hbm_gbps"], flag["hbm_gbps_source"], flag["hbm_gbps_measured"]) == (4300.0, "flag", 2988.0)
    assert (flag["pcie_gbps"], flag["pcie_gbps_source"]) == (B.PCIE_GBPS, "H200 default")
    cpu = B.floor_bandwidths(None, None, None, None)
    assert (cpu["hbm_gbps"], cpu["hbm_gbps_source"]) == (B.HBM_GBPS, "H200 default")
    assert B.measure_hbm_gbps(torch.device("cpu")) is None and B.measure_pcie_gbps(torch.device("cpu")) is None


def test_zero_copy_note_names_a_host_whose_sms_read_host_memory_slower_than_its_dma():
    note = B.zero_copy_note(34.0, 55.0)
    assert "34 GB/s" in note and "62%" in note and "1.6x" in note and "--kt-bits 8" in note
    assert B.zero_copy_note(45.0, 55.0) is None  # 82%, the H200's measure: a fast host
    assert B.zero_copy_note(None, 55.0) is None and B.zero_copy_note(34.0, None) is None  # not measured
    assert B.measure_zero_copy_gbps(torch.device("cpu")) is None


@pytest.mark.cuda
def test_zero_copy_rate_is_measured_by_the_gather_kernel_on_a_gpu():
    gbps = B.measure_zero_copy_gbps(torch.device("cuda"))
    assert gbps is not None and 1.0 < gbps < 200.0  # PCIe: Gen 3 x16 reads ~12 GB/s, Gen 5 ~55; none beats 200


def test_cpu_run_output_formats_and_defaults(tiny, tmp_path):
    """A bare bench fits the model (tiny: 2048 tokens); a CPU run shows no floor or PCIe figures; --output puts
    only the results on stdout; a budget that covers the context is named."""
    import csv
    import json
    from tailorkv.engine.bench.command import default_ctxs
    assert default_ctxs(8192) == [8192] and default_ctxs(131072) == [8192, 32768] and default_ctxs(2048) == [2048]
    args = ["--model", tiny, "--methods", "full,streamingllm", "--decode-steps", "2", "--warmup", "0",
            "--device", "cpu", "--budget", "4096", "--sink", "4"]
    r = bench_cmd(*args, "--out", str(tmp_path / "csv"), "--output", "csv")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(r.stdout.splitlines()))
    assert [(x["method"], x["ctx"], x["prompt"]) for x in rows] == [("full", "2048", "2030"),
                                                                     ("streamingllm", "2048", "2030")]
    assert "floor_ms" not in rows[0] and "pcie_bytes_per_token" not in rows[0] and "peak_device_bytes" not in rows[0]
    assert int(rows[0]["kv_device_bytes"]) > 0 and float(rows[0]["ms_per_token"]) > 0  # numbers, no units
    assert rows[0]["status"] == "ok" and rows[0]["error"] == "" and rows[0]["kv_host_bytes"] == "0"
    assert "streamingllm: --budget 4096 covers the whole context at 2k" in r.output
    assert "[1/2] full @ 2k (2030 prompt tokens): prefill " in r.output  # a log gets a line per cell
    assert "4300 GB/s" not in r.output and "floor" not in r.output.split("covers")[-1]  # (csv floats may hold 4300)
    r = bench_cmd(*args, "--out", str(tmp_path / "md"), "--output", "md")
    assert r.exit_code == 0 and r.stdout.startswith("| method | ctx | prompt |") and "| full | 2k | 2030 |" in r.stdout
    r = bench_cmd(*args, "--out", str(tmp_path / "json"), "--output", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["cells"][0]["prompt_tokens"] == 2030
    check_png(tmp_path / "json" / "peak_memory.png")


def test_warm_up_runs_one_short_cell_per_method_on_a_gpu_only(tiny):
    from tailorkv.engine.bench import driver
    from tailorkv.models.loader import load_model
    tiny = load_model(tiny)
    plan = driver.BenchPlan(ctxs=[256, 512], methods=["full", "streamingllm"], decode_steps=3, warmup=1)
    assert driver.warm_up(tiny, plan) == []  # on a CPU nothing needs compiling
    cells = driver.warm_up(tiny, plan, force=True)
    assert [(c["method"], c["ctx"], c["status"]) for c in cells] == [("full", 256, "ok"), ("streamingllm", 256, "ok")]
    assert all(len(c["greedy_tokens"]) == 1 + 2 + 2 for c in cells)  # prefill's token, 2 warm-up, 2 timed


@pytest.mark.parametrize("flags,line", [(["--profile", "2"], "--profile ignored: its stage breakdown needs a GPU"),
                                        (["--profile-prefill"], "--profile-prefill ignored: its stage breakdown needs"),
                                        (["--profile", "2", "--profile-prefill"],
                                         "--profile and --profile-prefill ignored: their stage breakdowns need")])
def test_profile_flags_on_cpu_name_only_those_given(tiny, tmp_path, flags, line):
    res = bench_cmd("--model", tiny, "--random-weights", "--ctx", "64", "--methods", "full", *FAST[:8], *flags,
                    "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    assert line in " ".join(res.output.split())
