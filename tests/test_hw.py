"""Hardware specs and the CloudMatrix384 topology."""

from __future__ import annotations

import msgspec
import pytest

from xds.errors import ConfigError
from xds.hw import (
    ASCEND_910C_DIE,
    CloudMatrix384,
    DieSpec,
    EngineSpec,
    Network,
    PodConfig,
    sources,
)
from xds.units import GB, KiB


def test_full_pod_shape():
    pod = CloudMatrix384()
    assert (pod.config.servers, pod.n_pod_chips, pod.n_pod_dies) == (48, 384, 768)
    s = pod.summary()
    assert s["aiv"] == 768 * 48
    assert s["kunpeng_cpus"] == 192


def test_flat_index_round_trips_through_locations():
    pod = CloudMatrix384()
    for i in (0, 1, 2, 15, 16, 500, 767):
        loc = pod.location(i)
        assert pod.index_of(loc.server, loc.chip, loc.die) == i
    assert pod.location(767) == pod.location(pod.index_of(47, 7, 1))
    assert list(pod.dies_of_server(1)) == list(range(16, 32))


def test_network_between_dies():
    pod = CloudMatrix384()
    assert pod.network_between(5, 5) is Network.LOCAL
    assert pod.network_between(0, 1) is Network.NOC  # two dies of chip 0
    assert pod.network_between(0, 2) is Network.UB  # another chip, same server
    assert pod.network_between(0, 767) is Network.UB  # another server: still UB
    assert pod.link_between(0, 767) is pod.config.ub
    assert pod.link_between(3, 3) is None


def test_attached_910b_servers_join_over_roce():
    pod = CloudMatrix384(servers=2, attached_910b_servers=2)
    assert pod.n_dies == 32 + 16
    first_b = pod.n_pod_dies
    assert pod.network_between(0, first_b) is Network.ROCE
    assert pod.network_between(first_b, first_b + 7) is Network.HCCS
    assert pod.network_between(first_b, first_b + 8) is Network.ROCE
    assert pod.spec_of(first_b).name == "Ascend 910B2"
    assert not pod.location(first_b).in_pod


def test_ub_is_at_least_twice_roce_and_dma_starts_slower_than_mte():
    pod = CloudMatrix384()
    c = pod.config
    assert c.ub.bandwidth >= 2 * c.roce.bandwidth  # SPEC 1.5
    assert c.engines.dma_startup_ns > c.engines.mte_startup_ns  # SPEC 1.5
    assert ASCEND_910C_DIE.ubuf_bytes == 192 * KiB
    assert ASCEND_910C_DIE.mte_max_bytes == 96 * KiB


def test_every_die_and_engine_number_has_a_source():
    for cls in (DieSpec, EngineSpec):
        described = sources(cls)
        numeric = [f for f in cls.__struct_fields__ if f != "name"]
        assert sorted(described) == sorted(numeric), cls
    pod = CloudMatrix384()
    for link in (pod.config.ub, pod.config.noc, pod.config.roce, pod.config.vpc, pod.config.hccs):
        assert link.source


def test_specs_are_frozen_and_round_trip_through_json():
    with pytest.raises(AttributeError):
        ASCEND_910C_DIE.aiv = 2  # type: ignore[misc]
    cfg = PodConfig(servers=4)
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=PodConfig) == cfg


def test_pod_parameters_are_validated_with_clear_errors():
    with pytest.raises(ConfigError, match="servers"):
        CloudMatrix384(servers=0)
    with pytest.raises(ConfigError, match="unknown pod parameter"):
        CloudMatrix384(sevrers=4)
    with pytest.raises(ConfigError, match="aiv"):  # checked where the spec is built
        msgspec.structs.replace(ASCEND_910C_DIE, aiv=64)
    pod = CloudMatrix384(servers=4)
    with pytest.raises(ConfigError, match="does not exist"):
        pod.check_die(64)
    with pytest.raises(ConfigError, match="integer"):
        pod.check_die("3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="server"):
        pod.index_of(4, 0, 0)


def test_small_pod_and_configurable_aivs():
    die = msgspec.structs.replace(ASCEND_910C_DIE, aiv=16)
    pod = CloudMatrix384(servers=4, die=die)
    assert pod.n_pod_dies == 64
    assert pod.die_spec.aiv == 16
    assert pod.config.ub.bandwidth == 196 * GB
