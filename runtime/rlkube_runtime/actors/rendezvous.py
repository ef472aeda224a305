"""Where the trainer ranks meet: a Ray task on rank 0's node, in a module of its own.

Ray imports a task's module in the worker that runs it; defined beside TrainerWorker, this task
made its worker import torch and transformers (seconds) before any rank could be created.
"""

from __future__ import annotations


def rendezvous_address() -> tuple[str, int]:
    """(this node's IP, a free port on it)."""
    from rlkube_runtime.serving.launch import free_port, node_ip

    address = node_ip()
    return address, free_port(address)
