"""`submit.py rl` runs jobs.rl as a recorded run on the local backend; verify-resume is reachable too."""

import json

# a small run: what these tests check (records, status, verify) does not need the default sizes
SMALL = ("--prompts-per-update", "2", "--max-new-tokens", "8")


def test_rl_through_the_launcher_is_recorded(cli, tmp_path):
    run_dir = tmp_path / "run"
    out = cli("rl", "--backend", "local", "--run-dir", str(run_dir), "--logs-dir", str(tmp_path / "logs"),
              "--algorithm", "grpo", "--updates", "2", "--reward", "test-token-value", *SMALL).stdout
    assert "finished" in out
    recs = [json.loads(line) for line in (run_dir / "stages.jsonl").read_text().splitlines()]
    (rec,) = recs
    assert rec["stage"] == "rl" and rec["status"] == "ok"
    assert rec["outputs"][0]["path"] == "rl/metrics.jsonl" and rec["outputs"][0]["rows"] == 2
    assert (run_dir / "rl" / "publications").is_dir()
    status = cli("status", str(run_dir)).stdout
    assert "rl/metrics.jsonl" in status and " ok " in status
    same = cli("verify-resume", str(run_dir / "rl"), str(run_dir / "rl"))
    assert same.returncode == 0


def test_verify_rehashes_rl_checkpoints_and_publications(cli, tmp_path):
    run_dir = tmp_path / "run"
    cli("rl", "--backend", "local", "--run-dir", str(run_dir), "--logs-dir", str(tmp_path / "logs"),
        "--algorithm", "ppo", "--updates", "2", "--reward", "test-token-value", *SMALL)
    ok = cli("verify", str(run_dir), "-v").stdout
    assert "ok       rl/checkpoints/update-000002" in ok and "ok       rl/publications/v000001" in ok, ok
    assert "RL checkpoints and publications match their manifests" in ok

    def flip(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    flip(run_dir / "rl" / "checkpoints" / "update-000002" / "critic.safetensors")
    flip(next((run_dir / "rl" / "publications" / "v000001").glob("*.safetensors")))
    bad = cli("verify", str(run_dir), check=False)
    assert bad.returncode == 1
    assert "CORRUPT  rl/checkpoints/update-000002: " in bad.stdout and "critic.safetensors" in bad.stdout
    assert "CORRUPT  rl/publications/v000001: " in bad.stdout and "; 2 corrupt" in bad.stdout, bad.stdout
