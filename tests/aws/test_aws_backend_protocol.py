"""The aws backend through the Backend interface (moto over HTTP): built from the run record,
dry_run prints the host command and calls nothing, launch starts the recorded command on a host,
poll reads only the mirrored record, retry starts the same command again on a host.
status, logs and cancel: tests/aws/test_aws_payload_e2e.py and tests/aws/test_aws_cancel.py."""

from __future__ import annotations

import json

from hobson.aws.clients import Clients
from hobson.aws.remote import RemoteRun
from hobson.launch import backends
from hobson.launch.backends.base import BackendOptions, Launch
from hobson.records import RunPaths, new_run_json, read_run_json, write_run_json
from tests.aws.conftest import agent_online, make_config


def test_aws_backend_dry_run_launch_poll_retry(aws_env, repo_copy, tmp_path):
    cfg_file = tmp_path / "aws.yaml"
    cfg = make_config()
    import dataclasses

    import yaml

    cfg_file.write_text(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg)))))
    paths = RunPaths.create(tmp_path / "runs" / "r-proto", tmp_path / "logs")
    paths.run_dir.mkdir(parents=True)
    opts = BackendOptions(ngpu=1, aws_config=str(cfg_file), detach=True)
    be = backends.create("aws", opts)
    write_run_json(paths, backends.record(new_run_json(paths, argv=["test"], backend=be.name, options={},
                                                       config_digests={}), be))
    be = backends.for_run(paths)  # from the record alone
    assert be.name == "aws" and be.options == opts and not be.waits
    be.runner.clients = Clients()
    be.runner.repo = be.repo = repo_copy
    agent_online(be.runner.clients)
    argv = ["recipe", "build", "--ngpu", "1"]
    launch = Launch(paths, [], host_argv=lambda: argv, echo=lambda s: None)

    dry = be.dry_run(launch)
    assert "recipe build --ngpu 1" in dry and "aws" not in read_run_json(paths)

    assert be.launch(launch) == 0  # detached: returns once the host started the run
    meta = read_run_json(paths)
    assert meta["host_argv"] == argv and RemoteRun.from_dict(meta["aws"]).argv == argv
    first = meta["aws"]["commands"]
    assert be.poll(meta).source == "record"

    assert be.retry(Launch(paths, [], host_argv=lambda: ["not", "used"], echo=lambda s: None)) == 0
    meta = read_run_json(paths)
    assert RemoteRun.from_dict(meta["aws"]).argv == argv  # the recorded command, not the caller's
    assert meta["aws"]["commands"] != first
