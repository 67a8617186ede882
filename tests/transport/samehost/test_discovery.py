"""Same host, reachable pools, and "is this address us": the pure deciders, and the
edges that read /proc against this machine's real files."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvd.transport.samehost.discovery import (
    HostFacts,
    dram_reachable,
    host_facts,
    local_host_names,
    names_this_daemon,
    parse_host_token,
    same_host_token,
    split_endpoint,
    stat_dir,
)

BOOT = "0f1e2d3c-aaaa-bbbb-cccc-123456789abc"
ME = HostFacts(boot_id=BOOT, machine_id="m1", ipc_ns=4026531839, pool_dir="/dev/shm",
               pool_dir_dev=22, pool_dir_ino=1)


def test_token_round_trips_odd_paths():
    facts = replace(ME, pool_dir="/var/lib/kvd pools;x=1/%20")
    assert parse_host_token(same_host_token(facts)) == facts


@pytest.mark.parametrize("token", ["", "kvdhost1", "kvdhost2;a;b;1;/d;2;3",
                                   "kvdhost1;a;b;x;/d;2;3", "kvdhost1;a;b;1;/d;-2;3",
                                   "kvdhost1;a;b;1;/d;2;3;4", "x" * 5000])
def test_bad_tokens_are_refused(token):
    with pytest.raises(ValueError, match="host token"):
        parse_host_token(token)


def test_this_process_reads_real_facts(tmp_path):
    facts = host_facts(str(tmp_path))
    assert facts.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert facts.ipc_ns == os.stat("/proc/self/ns/ipc").st_ino
    assert facts.pool_dir_id == (os.stat(tmp_path).st_dev, os.stat(tmp_path).st_ino)
    # Two daemons of this host with one pool directory: reachable by the directory.
    peer = parse_host_token(same_host_token(host_facts(str(tmp_path))))
    reach = dram_reachable(facts, peer, stat_dir(peer.pool_dir))
    assert reach.ok and reach.how == "shared_pool_dir"


def test_unreadable_facts_stay_unknown(tmp_path):
    facts = host_facts(str(tmp_path / "missing"), proc=str(tmp_path), etc=str(tmp_path))
    assert facts.boot_id == "" and facts.ipc_ns == 0 and facts.pool_dir_id is None
    reach = dram_reachable(facts, ME, (22, 1))
    assert not reach.ok and "no boot id" in reach.reason


def test_another_kernel_is_never_reachable_even_with_equal_everything_else():
    peer = replace(ME, boot_id="another-boot")
    reach = dram_reachable(ME, peer, (22, 1))
    assert not reach.ok and "boot id differs" in reach.reason


def test_same_kernel_shared_dir_or_same_ipc_namespace():
    # Two pods of one node (other IPC namespaces, other machine ids) sharing a hostPath.
    pod = replace(ME, machine_id="m2", ipc_ns=4026532000, pool_dir="/var/run/kvd/pools",
                  pool_dir_dev=64769, pool_dir_ino=777)
    assert dram_reachable(ME, pod, (64769, 777)).how == "shared_pool_dir"
    # The same path here is another directory (each pod its own emptyDir): not shared.
    reach = dram_reachable(ME, pod, (64769, 778))
    assert not reach.ok and "another directory here" in reach.reason
    reach = dram_reachable(ME, pod, None)
    assert not reach.ok and "missing here" in reach.reason
    # hostIPC pods or two processes of one host: the same IPC namespace.
    ipc = replace(pod, ipc_ns=ME.ipc_ns)
    assert dram_reachable(ME, ipc, None).how == "same_ipc_namespace"


@pytest.mark.parametrize(("address", "expected"), [
    ("tcp://127.0.0.1:7101", ("tcp", "127.0.0.1", 7101)),
    ("TCP://LocalHost.:7101", ("tcp", "localhost", 7101)),
    ("tcp://[::1]:7101", ("tcp", "::1", 7101)),
    ("tcp://[::ffff:127.0.0.1]:7101", ("tcp", "127.0.0.1", 7101)),
    ("tcp://[fe80::1%eth0]:9", ("tcp", "fe80::1", 9)),
    ("tcp://eth0;10.0.0.2:80", ("tcp", "10.0.0.2", 80)),
    ("ipc:///run/kvd/e.sock", ("ipc", "/run/kvd/e.sock", None)),
])
def test_split_endpoint(address, expected):
    assert split_endpoint(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1:1", "tcp://h", "tcp://h:x", "tcp://h:0",
                                     "tcp://[::1:5", "udp://h:1", "tcp://:5"])
def test_split_endpoint_refuses(address):
    with pytest.raises(ValueError):
        split_endpoint(address)


LOCAL = ["node-7", "node-7.cluster.local", "10.1.2.3"]


@pytest.mark.parametrize(("own", "address", "ours"), [
    # Bound on loopback (the default): its spellings, not another loopback address.
    ("tcp://127.0.0.1:7101", "tcp://127.0.0.1:7101", True),
    ("tcp://127.0.0.1:7101", "tcp://localhost:7101", True),
    ("tcp://127.0.0.1:7101", "tcp://0.0.0.0:7101", True),
    ("tcp://127.0.0.1:7101", "tcp://[::ffff:127.0.0.1]:7101", True),
    ("tcp://127.0.0.1:7101", "tcp://127.0.0.2:7101", False),
    ("tcp://127.0.0.1:7101", "tcp://127.0.0.1:7102", False),
    ("tcp://127.0.0.1:7101", "tcp://10.1.2.3:7101", False),
    ("tcp://[::1]:7101", "tcp://localhost:7101", True),
    ("tcp://[::1]:7101", "tcp://[::]:7101", True),
    ("tcp://[::1]:7101", "tcp://127.0.0.1:7101", False),
    # Bound on every address: loopback, the wildcard, this host's names and addresses.
    ("tcp://0.0.0.0:7101", "tcp://127.0.0.1:7101", True),
    ("tcp://*:7101", "tcp://localhost:7101", True),
    ("tcp://0.0.0.0:7101", "tcp://0.0.0.0:7101", True),
    ("tcp://0.0.0.0:7101", "tcp://[::1]:7101", True),
    ("tcp://0.0.0.0:7101", "tcp://10.1.2.3:7101", True),
    ("tcp://0.0.0.0:7101", "tcp://NODE-7.cluster.local.:7101", True),
    ("tcp://0.0.0.0:7101", "tcp://10.1.2.4:7101", False),
    ("tcp://0.0.0.0:7101", "tcp://node-8:7101", False),
    ("tcp://0.0.0.0:7101", "tcp://10.1.2.3:7100", False),
    # Bound on one address of this host: that address, or a name of this host.
    ("tcp://10.1.2.3:7101", "tcp://10.1.2.3:7101", True),
    ("tcp://10.1.2.3:7101", "tcp://node-7:7101", True),
    ("tcp://10.1.2.3:7101", "tcp://127.0.0.1:7101", False),
    ("tcp://10.1.2.3:7101", "tcp://localhost:7101", False),
    # Advertised (NAT, a Service): matched as written, with its own port.
    ("tcp://kvd-node-7.kvd.svc:17101", "tcp://KVD-node-7.kvd.svc:17101", True),
    ("tcp://kvd-node-7.kvd.svc:17101", "tcp://kvd-node-7.kvd.svc:7101", False),
    # Garbage names nothing.
    ("tcp://127.0.0.1:7101", "not an address", False),
    ("tcp://127.0.0.1:7101", "ipc:///tmp/x", False),
])
def test_names_this_daemon_tcp(own, address, ours):
    assert names_this_daemon(address, [own], local_hosts=LOCAL) is ours


def test_names_this_daemon_among_several_own_addresses():
    own = ["tcp://0.0.0.0:7101", "tcp://10.1.2.3:7101", "ipc:///run/kvd/peer.sock",
           "not parseable"]
    assert names_this_daemon("tcp://localhost:7101", own)
    assert names_this_daemon("ipc:///run/kvd/./peer.sock", own)
    assert not names_this_daemon("tcp://localhost:7100", own)


def test_names_this_daemon_ipc_relative_and_symlinked(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "peer.sock").touch()
    (tmp_path / "link").symlink_to(real)
    own = [f"ipc://{real}/peer.sock"]
    assert names_this_daemon(f"ipc://{tmp_path}/link/peer.sock", own)
    assert names_this_daemon("ipc://real/peer.sock", own, cwd=str(tmp_path))
    assert names_this_daemon("ipc://link/../real/peer.sock", own, cwd=str(tmp_path))
    assert not names_this_daemon(f"ipc://{real}/other.sock", own)
    assert names_this_daemon("ipc://@kvd-peer", ["ipc://@kvd-peer"])
    assert not names_this_daemon("ipc://@kvd-peer", ["ipc://@kvd-peer2"])


def test_local_host_names_include_this_hostname():
    import socket

    names = local_host_names()
    assert socket.gethostname().lower().rstrip(".") in names
    assert names_this_daemon(f"tcp://{socket.gethostname()}:7101", ["tcp://0.0.0.0:7101"],
                             local_hosts=names)
