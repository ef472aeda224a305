"""Cross-node connections use the node's own address: the interface gloo and NCCL are told, and the
trainer ranks' check that they reach each other there, with errors that name address and node."""

from __future__ import annotations

import datetime
import json
import socket
import threading

import pytest
import torch.distributed as dist
from rlkube_runtime.node_network import (
    NodeNetworkError,
    Unreached,
    check_ranks_reach_each_other,
    interface_holding,
    local_interfaces,
    socket_ifname_env,
    unreached_message,
)
from rlkube_runtime.serving.launch import EngineLaunchSpec, engine_env

# A pod with a cluster network: loopback, the pod network, and a second network (multus) on net1.
POD = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.77.0.3", "fe80::1%eth0"], "net1": ["192.168.5.3"]}


def test_the_interface_chosen_is_the_one_holding_the_node_address_not_the_first_or_loopback():
    assert interface_holding("10.77.0.3", POD) == "eth0"
    assert interface_holding("192.168.5.3", POD) == "net1"
    assert interface_holding("fe80::1", POD) == "eth0"  # an IPv6 zone (%eth0) is not part of the address


def test_an_address_no_interface_holds_is_an_error_naming_it_the_host_and_every_interface():
    with pytest.raises(NodeNetworkError) as err:
        interface_holding("10.77.0.9", POD)
    message = str(err.value)
    assert "10.77.0.9" in message and f"host {socket.gethostname()}" in message
    assert "eth0 10.77.0.3 fe80::1%eth0" in message and "net1 192.168.5.3" in message
    assert "GLOO_SOCKET_IFNAME" in message and "spec.resources.env" in message


def test_gloo_and_nccl_are_told_the_node_interface_nccl_by_exact_name():
    assert socket_ifname_env("10.77.0.3", {}, POD) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}


def test_an_interface_the_user_named_is_kept_and_the_other_variable_still_set():
    assert socket_ifname_env("10.77.0.3", {"NCCL_SOCKET_IFNAME": "ib0"}, POD) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert socket_ifname_env("10.77.0.3", {"GLOO_SOCKET_IFNAME": "net1"}, POD) == {"NCCL_SOCKET_IFNAME": "=eth0"}


def test_with_both_variables_set_the_interfaces_are_not_looked_up():
    both = {"GLOO_SOCKET_IFNAME": "net1", "NCCL_SOCKET_IFNAME": "net1"}
    # An address no interface holds would raise if it were looked up.
    assert socket_ifname_env("10.77.0.9", both, {}) == {}


def test_loopback_and_wildcard_addresses_set_nothing():
    assert socket_ifname_env("127.0.0.1", {}, {}) == {}
    assert socket_ifname_env("0.0.0.0", {}, {}) == {}


def test_an_engine_gets_the_interface_of_the_address_it_serves_on_and_its_own_env_wins():
    spec = EngineLaunchSpec(kind="builtin", model_path="/m", log_dir="/l", name="e", host="192.168.5.3",
                            gpu_ids=(2, 3), env={"NCCL_SOCKET_IFNAME": "=eth0"})
    assert engine_env(spec, {}, POD) == {
        "GLOO_SOCKET_IFNAME": "net1", "NCCL_SOCKET_IFNAME": "=eth0", "CUDA_VISIBLE_DEVICES": "2,3",
    }
    assert engine_env(spec, {"GLOO_SOCKET_IFNAME": "eth0"}, POD) == {"NCCL_SOCKET_IFNAME": "=eth0", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_the_unreachable_message_names_both_ranks_their_nodes_the_address_and_the_reason():
    message = unreached_message([
        Unreached(rank=1, node="10.77.0.4 (host trainer-1)", peer=0, peer_address="10.77.0.3:41000",
                  peer_node="10.77.0.3 (host trainer-0)", reason="Connection refused"),
    ])
    assert ("trainer rank 1 on 10.77.0.4 (host trainer-1) -> trainer rank 0 at 10.77.0.3:41000 on "
            "10.77.0.3 (host trainer-0): Connection refused") in message
    assert "NetworkPolicy" in message and "GLOO_SOCKET_IFNAME" in message


def _store() -> dist.HashStore:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    return store


def test_ranks_that_reach_each_other_pass_the_check():
    store, errors = _store(), []

    def rank(r: int) -> None:
        try:
            check_ranks_reach_each_other(store, r, 3, "127.0.0.1", dial_timeout_s=5)
        except Exception as err:  # reported below, with the rank
            errors.append((r, err))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []


def test_a_rank_that_cannot_be_dialled_fails_every_rank_with_its_address_and_node_named():
    # Rank 1 publishes an address where nothing listens (a port bound, then closed): rank 0's dial
    # is refused. The test plays rank 1 through the store; rank 0 runs the real check.
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    store, raised = _store(), []
    rank0 = threading.Thread(target=lambda: raised.append(_raises(store)))
    rank0.start()
    store.set("rlkube/ranks/at/1", json.dumps({"address": dead, "node": "10.77.0.4 (host trainer-1)"}))
    store.set("rlkube/ranks/result/1", json.dumps([]))
    rank0.join(30)
    assert len(raised) == 1 and isinstance(raised[0], NodeNetworkError), raised
    message = str(raised[0])
    assert f"trainer rank 0 on 127.0.0.1 (host {socket.gethostname()}) -> trainer rank 1 at {dead} on 10.77.0.4 (host trainer-1): Connection refused" in message, message
    # Rank 0's own listener was published for rank 1 to dial.
    assert json.loads(store.get("rlkube/ranks/at/0"))["address"].startswith("127.0.0.1:")


def test_a_rank_fails_too_when_only_a_peer_could_not_reach_it():
    store, raised = _store(), []
    peer_failure = Unreached(1, "10.77.0.4 (host trainer-1)", 0, "127.0.0.1:1", "127.0.0.1", "no answer within 20 s")
    rank0 = threading.Thread(target=lambda: raised.append(_raises(store)))
    rank0.start()
    with socket.create_server(("127.0.0.1", 0)) as listener:  # rank 1 listens: rank 0 reaches it
        store.set("rlkube/ranks/at/1", json.dumps({"address": f"127.0.0.1:{listener.getsockname()[1]}", "node": "n1"}))
        store.set("rlkube/ranks/result/1", json.dumps([peer_failure.__dict__]))
        rank0.join(30)
    assert len(raised) == 1 and isinstance(raised[0], NodeNetworkError), raised
    assert str(raised[0]).count(" -> ") == 1 and "trainer rank 1 on 10.77.0.4 (host trainer-1) -> trainer rank 0" in str(raised[0])


def _raises(store) -> Exception | None:
    try:
        check_ranks_reach_each_other(store, 0, 2, "127.0.0.1", dial_timeout_s=5)
    except Exception as err:
        return err
    return None


def test_this_machines_interfaces_are_read_with_their_addresses():
    interfaces = local_interfaces()
    assert interface_holding("127.0.0.1", interfaces) in interfaces  # loopback is always there
