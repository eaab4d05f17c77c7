"""bench/decode_routes.py picks a route per shape from skinny_gemm's timings, and the models read the
table it writes (the GPU half: tests/models/test_skinny_on_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hobson.models import skinny

REPO = Path(__file__).resolve().parents[2]


def test_routes_from_session_12s_h200_timings_and_the_table_they_make(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import decode_routes  # bench/ is on pytest's pythonpath

    timings = json.loads((REPO / "bench" / "results" / "skinny_gemm-2026-12-02.json").read_text())
    routes = decode_routes.pick_routes(timings, 0.03)
    got = {(r["n"], r["k"], r["dtype"]): r["route"] for r in routes}
    # the shapes where a repeatable Triton tile was 3% or more faster than cuBLAS on the H200 (µs there:
    # Nanbeige o 13.5 vs 14.3, gate|up 32.8 vs 34.4, down 20.2 vs 21.2; Huginn mlp.fc 94.9 vs 100.6)
    assert got == {(3072, 6144, "bfloat16"): "triton 128x128 s4 st4",
                   (21504, 3072, "bfloat16"): "triton 64x128 s1 st3",
                   (3072, 10752, "bfloat16"): "triton 64x128 s4 st4",
                   (35840, 5280, "bfloat16"): "triton 64x128 s1 st6",
                   (5280, 17920, "bfloat16"): "triton 64x128 s2 st4",
                   (35840, 5280, "float16"): "triton"}
    assert all(r["us"] < 0.97 * r["cublas_us"] for r in routes)
    assert decode_routes.pick_routes(timings, 0.10) == []  # none is 10% faster
    table = tmp_path / "routes.json"
    table.write_text(json.dumps(routes))
    monkeypatch.setenv("HOBSON_GEMM16_ROUTES", str(table))
    skinny._routes.cache_clear()
    try:
        assert skinny._routes("NVIDIA H200")[(3072, 6144, "bfloat16")] == "triton 128x128 s4 st4"
        assert skinny.parse_triton("triton 128x128 s4 st4", 3072, 6144, torch.bfloat16, 132) == skinny.Plan(
            128, 128, 4, 4, 4)
        x, w = torch.zeros(16, 6144, dtype=torch.bfloat16), torch.zeros(3072, 6144, dtype=torch.bfloat16)
        assert skinny.route(x, w) is None  # a CPU product is torch's, whatever the table says
        monkeypatch.delenv("HOBSON_GEMM16_ROUTES")
        skinny._routes.cache_clear()
        assert skinny._routes("a card not measured") == {}  # no table: cuBLAS for every 16-bit shape
    finally:
        skinny._routes.cache_clear()


@pytest.mark.parametrize(("text", "says"), [
    ("not json", "not a readable JSON file"),
    ('{"n": 1}', "expected a JSON list"),
    ('[{"n": 3072, "k": 6144, "dtype": "bfloat16", "route": "cublas sideways"}]', "entry 0"),
    ('[{"n": 3072, "k": 6144, "dtype": "float32", "route": "triton"}]', "dtype bfloat16 or float16"),
])
def test_a_bad_route_table_is_one_error_naming_the_file_and_entry(text: str, says: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from hobson.errors import ConfigError

    table = tmp_path / "routes.json"
    table.write_text(text)
    monkeypatch.setenv("HOBSON_GEMM16_ROUTES", str(table))
    skinny._routes.cache_clear()
    try:
        with pytest.raises(ConfigError, match=says) as e:
            skinny._routes("NVIDIA H200")
        assert str(table) in str(e.value)
    finally:
        skinny._routes.cache_clear()


def test_interleaved_runs_are_summarized_by_the_fastest_run_against_the_fastest_cublas_run() -> None:
    import decode_routes

    rows = [{"model": "nanbeige", "variant": "cuBLAS", "decode_ms_per_step": 6.62,
             "engine_vs_trainer_logprob_gap": 0.27},
            {"model": "nanbeige", "variant": "routes", "decode_ms_per_step": 6.34,
             "engine_vs_trainer_logprob_gap": 0.26},
            {"model": "nanbeige", "variant": "cuBLAS", "decode_ms_per_step": 6.50,
             "engine_vs_trainer_logprob_gap": 0.25},
            {"model": "nanbeige", "variant": "routes", "error": "TimeoutExpired"}]
    table = {t["variant"]: t for t in decode_routes.summarize(rows)}
    assert table["cuBLAS"]["runs"] == [6.62, 6.50] and table["cuBLAS"]["decode_ms_per_step"] == 6.50
    assert table["cuBLAS"]["engine_vs_trainer_logprob_gap"] == 0.27  # the largest of the runs
    assert table["routes"]["errors"] == 1 and table["routes"]["runs"] == [6.34]
    assert table["routes"]["vs_cublas"] == pytest.approx(6.50 / 6.34)
    assert table["cuBLAS"]["vs_cublas"] == 1.0


def test_the_shipped_route_table_is_per_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """A route measured on one card is not taken on another (the fastest kernel per shape differs)."""
    monkeypatch.delenv("HOBSON_GEMM16_ROUTES", raising=False)
    monkeypatch.setattr(skinny, "ROUTES_16BIT", {"NVIDIA H100 80GB HBM3": {(3072, 6144, "bfloat16"): "cublaslt"}})
    skinny._routes.cache_clear()
    try:
        assert skinny._routes("NVIDIA H100 80GB HBM3") == {(3072, 6144, "bfloat16"): "cublaslt"}
        assert skinny._routes("NVIDIA H200") == {}
        monkeypatch.setenv("HOBSON_GEMM16_ROUTES", "none")  # the bench's cuBLAS row
        skinny._routes.cache_clear()
        assert skinny._routes("NVIDIA H100 80GB HBM3") == {}
    finally:
        skinny._routes.cache_clear()


def test_the_shipped_routes_are_valid_and_name_official_decode_products() -> None:
    """Every shipped route is a label the engine can run (a swept Triton label parses into a launch)
    for a 16-bit product of an official model's decode step at these shapes (a typo'd shape would
    silently never match, a bad label would fail mid-decode)."""
    import json

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "official-models"
    nb = json.loads((fixtures / "nanbeige4.2-3b.config.json").read_text())
    hg = json.loads((fixtures / "huginn-0125.config.json").read_text())
    E, Im, V, D = nb["hidden_size"], nb["intermediate_size"], nb["vocab_size"], nb["head_dim"]
    q, kv = nb["num_attention_heads"] * D, nb["num_key_value_heads"] * D
    products = {(q + 2 * kv, E), (E, q), (2 * Im, E), (E, Im), (V, E)}
    He, Hi = hg["n_embd"], hg["intermediate_size"]
    products |= {(3 * He, He), (He, He), (2 * Hi, He), (He, Hi), (hg["padded_vocab_size"], He)}  # adapter halves: E × E
    assert skinny.ROUTES_16BIT, "the shipped table is empty"
    for card, table in skinny.ROUTES_16BIT.items():
        for (n, k, dtype), label in table.items():
            assert (n, k) in products, (card, n, k)
            assert dtype in ("bfloat16", "float16") and skinny._ROUTE.fullmatch(label), (card, label)
            if label.startswith("triton"):
                assert skinny.parse_triton(label, n, k, getattr(torch, dtype), 132) is not None


def test_the_bench_runs_each_variant_interleaved_and_writes_its_table(tmp_path: Path) -> None:
    """The plumbing, on CPU at tiny size: a given table, two variants twice, one JSON row per run and
    one summary line per variant (on a GPU the same runs time the routes; here no product is routed)."""
    import subprocess
    import sys

    table = tmp_path / "routes.json"
    table.write_text('[{"n": 3072, "k": 6144, "dtype": "bfloat16", "route": "cublaslt"}]')
    out = tmp_path / "decode_routes.json"
    r = subprocess.run([sys.executable, "bench/decode_routes.py", "--models", "nanbeige", "--routes", str(table),
                        "--repeat", "2", "--timeout", "300", "--json", str(out), "--rollout-args",
                        f"--size tiny --device cpu --engine-device cpu --batch 2 --prompt-tokens 8 --new-tokens 4 "
                        f"--work {tmp_path / 'work'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(row["variant"], row["run"]) for row in res["rows"]] == [("cuBLAS", 0), ("routes", 0), ("cuBLAS", 1),
                                                                     ("routes", 1)]
    assert res["routes"] == json.loads(table.read_text())
    assert {t["variant"]: len(t["runs"]) for t in res["table"]} == {"cuBLAS": 2, "routes": 2}
    assert "| nanbeige | routes |" in r.stdout


def test_a_bad_table_given_to_the_bench_is_one_error_before_any_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    table = tmp_path / "routes.json"
    table.write_text('[{"n": 3072, "k": 6144, "dtype": "bfloat16", "route": "cublas sideways"}]')
    r = subprocess.run([sys.executable, "bench/decode_routes.py", "--routes", str(table)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--routes: {table}:" in r.stderr and "entry 0" in r.stderr and "rl_gpu" not in r.stdout
