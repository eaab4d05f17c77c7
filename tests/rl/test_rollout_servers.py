"""N rollout servers give the same run for any N: an update's requests are cut into units
(``--rollout-unit``: consecutive slices in the fixed request order), unit k runs as one generate
call on server k mod N, and the trainer collects them in order; so tokens, log-probs, rewards,
traces, weights and digests are byte-identical for N = 1 (in-process), 2 and 3, over both
transports, and across a stop with N = 2 and a resume with N = 3. A server unlike the first is
refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hobson.io import read_jsonl
from hobson.jobs.rl import main
from hobson.rl.verify_resume import compare_runs
from tests.rl.servers import start_servers, stop_server

# 3 prompts x 2 completions = 6 requests, one per unit: 2 x 3 units, prompts of different lengths
ARGS = [
    "--algorithm", "grpo", "--reward", "test-token-value", "--max-new-tokens", "6", "--trainer", "torch",
    "--prompts-per-update", "3", "--completions-per-prompt", "2", "--updates", "2", "--lr", "0.1",
    "--rollout-unit", "1", "--engine-timeout", "60", "--publish-timeout", "60",
]


def _run(out: Path, template: str, n: int, *extra: str) -> None:
    procs = start_servers(template, n)
    try:
        assert main([*ARGS, "--output", str(out), "--rollout-servers", str(n), "--engine-address-file", template,
                     *extra]) == 0
        outs = [p.communicate(timeout=30)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * n, outs  # the trainer shut each down
    finally:
        for p in procs:
            stop_server(p)


def _same(a: Path, b: Path) -> None:
    items = compare_runs(a, b)
    assert len(items) > 20
    assert [i.line() for i in items if i.difference] == []


@pytest.mark.slow
def test_any_number_of_servers_gives_the_same_run(tmp_path: Path, one_thread: None) -> None:
    """Slow (~60 s on 2 cores): nine rollout servers in all, for four runs."""
    ref = tmp_path / "in-process"
    assert main([*ARGS, "--output", str(ref)]) == 0
    rows = read_jsonl(ref / "rollouts" / "update-000001.jsonl")
    assert len(rows) == 6 and len({len(r["prompt_tokens"]) for r in rows}) >= 2

    template = str(tmp_path / "engine" / "address-{index}.json")
    for n, transport in ((2, "shared-dir"), (3, "dist")):
        out = tmp_path / f"n{n}-{transport}"
        _run(out, template, n, "--transport", transport)
        _same(ref, out)
        for update in (1, 2):
            served = read_jsonl(out / "rollouts" / f"update-{update:06d}.jsonl")
            # unit k on server k mod n, each row with its server's pid
            assert [r["engine_server"] for r in served] == [k % n for k in range(6)]
            assert len({r["engine_pid"] for r in served}) == n
    # stopped with 2 servers, resumed with 3
    part = tmp_path / "2-then-3"
    _run(part, template, 2, "--stop-after", "1")
    _run(part, template, 3, "--resume")
    _same(ref, part)
    assert {r["engine_server"] for r in read_jsonl(part / "rollouts" / "update-000002.jsonl")} == {0, 1, 2}


def test_rollout_unit_is_part_of_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         one_thread: None) -> None:
    out = tmp_path / "run"
    args = ARGS[: ARGS.index("--rollout-unit")] + ARGS[ARGS.index("--rollout-unit") + 2 :]
    assert main([*args, "--output", str(out), "--rollout-unit", "2", "--stop-after", "1"]) == 0
    assert json.loads((out / "run.json").read_text())["rl"]["settings"]["rollout_unit"] == 2
    capsys.readouterr()
    assert main([*args, "--output", str(out), "--rollout-unit", "3", "--resume"]) != 0
    assert "rollout_unit: run has 2, this call 3" in capsys.readouterr().err


def test_a_server_unlike_the_first_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = str(tmp_path / "engine" / "address-{index}.json")
    # server 1's kernels would take another code path: its completions could differ in the last bits
    procs = start_servers(template, 2, env={1: {"ATEN_CPU_CAPABILITY": "default"}})
    try:
        assert main([*ARGS, "--output", str(tmp_path / "run"), "--rollout-servers", "2", "--engine-address-file",
                     template]) != 0
    finally:
        for p in procs:
            stop_server(p)
    err = capsys.readouterr().err
    assert "rollout server 1 (rollout component" in err, err
    assert "differs from server 0: cpu_capability 'DEFAULT'" in err, err


def test_several_servers_need_an_index_in_the_address_file(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--output", str(tmp_path / "run"), "--rollout-servers", "2", "--engine-address-file",
                 str(tmp_path / "address.json")]) != 0
    assert "rollout_servers 2: engine_address_file must name each server's address file with {index}" in (
        capsys.readouterr().err)
