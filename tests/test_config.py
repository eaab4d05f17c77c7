import re

import pytest

from hobson.config import load_config
from hobson.errors import ConfigError
from hobson.launch.options import DEFAULT_CLUSTER, DEFAULT_RECIPE, ClusterProfile, RecipeConfig


def test_shipped_configs_load():
    assert load_config(DEFAULT_RECIPE, RecipeConfig).corpus.scale == 1.0
    assert load_config(DEFAULT_CLUSTER, ClusterProfile).signal_seconds == 120


def test_unknown_keys_are_all_named_with_file_and_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("corpus:\n  scale: 2\n  sclae: 3\nteacher:\n  modle: x\nextra: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, RecipeConfig)
    msg = str(e.value)
    assert f"{p}:3: unknown key 'corpus.sclae'" in msg
    assert f"{p}:5: unknown key 'teacher.modle'" in msg
    assert f"{p}:6: unknown key 'extra'" in msg
    assert "scale (default 1.0)" in msg


def test_wrong_type_and_invalid_value(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("corpus:\n  seed: many\n")
    with pytest.raises(ConfigError, match=r":2: 'corpus.seed' must be int, got 'many'"):
        load_config(p, RecipeConfig)
    p.write_text("corpus:\n  scale: -1\n")
    with pytest.raises(ConfigError, match=r":2: 'corpus.scale' must be > 0, got -1"):
        load_config(p, RecipeConfig)


def test_cluster_profile_stage_overrides_are_validated(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("stages:\n  teacher: {time: '04:00:00', gpu: 2}\n")
    with pytest.raises(ConfigError, match="unknown key 'gpu'"):
        load_config(p, ClusterProfile)


def test_cluster_profile_rendezvous_and_interface_are_validated(tmp_path):
    p = tmp_path / "c.yaml"
    for text, message in (("rdzv_address: 'n1; rm -rf /'\n", "rdzv_address must be a host name"),
                          ("rdzv_address: 10.0.0.1:29500\n", "rdzv_address must be a host name"),
                          ("socket_ifname: 'eth 0'\n", "socket_ifname must be network interface names"),
                          ("socket_ifname: averyveryverylongname0\n", "socket_ifname must be network interface names"),
                          ("socket_ifname: 3\n", "'socket_ifname' must be"),
                          ("rdzv_port: 29500\n", "unknown key 'rdzv_port'")):
        p.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(p, ClusterProfile)
    p.write_text("rdzv_address: head-0.cluster\nsocket_ifname: eth0,ib0\n")
    prof = load_config(p, ClusterProfile)
    assert (prof.rdzv_address, prof.socket_ifname) == ("head-0.cluster", "eth0,ib0")
