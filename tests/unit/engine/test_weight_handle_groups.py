"""An engine over several GPUs takes one /update_weights_from_tensor payload per tensor-parallel
rank, each pointing at memory its own GPU's trainer rank staged. Two trainer-rank processes (the
ranks on one engine's two GPUs) share a store, stage each bucket of the same weights in their own
shared memory, and the leader posts both payloads in one request; the receiving side opens
payload i as SGLang's TP rank i does (SGLang's own deserializer) and as the built-in engine does.
On a GPU the same runs with CUDA IPC handles naming the GPU by UUID (test at the end)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
from aiohttp import web
from aiohttp.test_utils import TestServer
from sglang_testutil import require_pinned_sglang

from rlkube_runtime.engine.weights import decode_shared_named_tensors
from rlkube_runtime.memory import unique_named_tensors

RANKS = 2
BUCKET_BYTES = 300  # below the largest tensor (512 bytes): several buckets, one exchange each
TIMEOUT_S = 60


def _model(position: int) -> torch.nn.Module:
    """What every trainer rank holds (the same weights), plus a marker of which rank staged it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model.register_buffer("rank_marker", torch.full((2,), float(position)))
    return model


def _trainer_rank(position: int, port: int, url: str, device: str, fail_bucket: int | None, out) -> None:
    """One trainer rank's push, as TrainerWorker.push_weights makes it (a spawned process)."""
    from rlkube_runtime.weight_sync import HandleGroup, WeightSender

    store = dist.TCPStore("127.0.0.1", port, RANKS + 1, False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    sender = WeightSender(_model(position).to(device), dtype=torch.float32, bucket_bytes=BUCKET_BYTES,
                          device=torch.device(device))
    if fail_bucket is not None:
        stage, seen = sender._stage, []

        def failing_stage(named, bucket):
            seen.append(bucket)
            if len(seen) - 1 == fail_bucket:
                raise MemoryError("no room for the staging buffer")
            return stage(named, bucket)

        sender._stage = failing_stage
    handles = HandleGroup(store, engine=0, position=position, size=RANKS, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    report = sender.push([url], transport="tensor", version="v3", handles=handles)
    out.put((position, dict(report.failed), report.requests_per_engine))


class _Receiver:
    """/update_weights_from_tensor as an engine's TP ranks read it: payload i opened by rank i,
    copied out before the answer (after it, the trainer ranks reuse their staging buffers)."""

    def __init__(self, decode):
        self.decode = decode
        self.requests: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        opened = [{name: t.clone() for name, t in self.decode(p)} for p in body["serialized_named_tensors"]]
        self.requests.append({"payloads": opened, "version": body["weight_version"], "format": body["load_format"],
                              "raw": body["serialized_named_tensors"]})
        return web.json_response({"success": True, "message": "ok"})


async def _push_from_two_ranks(url: str, *, device: str = "cpu", fail_bucket: int | None = None):
    """Both ranks' (position, failed, requests) once they have returned."""
    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, RANKS + 1, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    out = context.Queue()
    ranks = [context.Process(target=_trainer_rank, args=(p, store.port, url, device, fail_bucket, out))
             for p in range(RANKS)]
    for rank in ranks:
        rank.start()
    try:
        results = [await asyncio.to_thread(out.get, timeout=TIMEOUT_S * 2) for _ in ranks]
    finally:
        await _reap(ranks)
    assert [rank.exitcode for rank in ranks] == [0] * RANKS
    return sorted(results)


async def _reap(ranks, timeout_s: float = 30) -> None:
    """Wait for the rank processes to exit, killing what is left at the deadline. Not
    Process.join: it waits on a pipe the rank's torch_shm_manager (started for file_system
    sharing) inherits and holds open for a minute after the rank has exited."""
    deadline = time.monotonic() + timeout_s
    while any(rank.is_alive() for rank in ranks) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for rank in ranks:
        if rank.is_alive():
            rank.kill()
            rank.join()


async def _serve(receiver: _Receiver) -> TestServer:
    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/update_weights_from_tensor", receiver.handle)
    server = TestServer(app)
    await server.start_server()
    return server


def _sglang_decode(payload: str):
    """SGLang's TP rank: MultiprocessingSerializer.deserialize(serialized_named_tensors[tp_rank])."""
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer.deserialize(payload)


def _check_every_bucket_came_from_both_ranks_in_order(receiver: _Receiver) -> None:
    expected = dict(unique_named_tensors(_model(0)))
    got: dict[str, list[torch.Tensor]] = {}
    assert len(receiver.requests) > 2  # several buckets, one request each
    for i, request in enumerate(receiver.requests):
        assert len(request["payloads"]) == RANKS and request["format"] is None
        assert request["version"] == ("v3" if i == len(receiver.requests) - 1 else None)
        assert [set(p) for p in request["payloads"]] == [set(request["payloads"][0])] * RANKS
        for position, payload in enumerate(request["payloads"]):
            for name, tensor in payload.items():
                got.setdefault(name, [None] * RANKS)[position] = tensor
    assert set(got) == set(expected)
    for name, per_rank in got.items():
        for position, tensor in enumerate(per_rank):
            want = torch.full((2,), float(position)) if name == "rank_marker" else expected[name]
            assert torch.equal(tensor.cpu(), want), (name, position)


@pytest.mark.parametrize("decoder", ["sglang", "builtin"])
async def test_two_ranks_on_one_engines_gpus_hand_it_one_payload_each_in_rank_order(decoder):
    if decoder == "sglang":
        require_pinned_sglang()
    decode = _sglang_decode if decoder == "sglang" else decode_shared_named_tensors
    receiver = _Receiver(decode)
    server = await _serve(receiver)
    try:
        results = await _push_from_two_ranks(str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()
    assert [(position, failed) for position, failed, _ in results] == [(0, {}), (1, {})]
    assert results[0][2] == len(receiver.requests)
    _check_every_bucket_came_from_both_ranks_in_order(receiver)


async def test_an_engine_that_refuses_the_payloads_stops_every_rank_of_its_group():
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    results = await _push_from_two_ranks(dead)
    assert [position for position, _, _ in results] == [0, 1]
    for _, failed, _ in results:
        assert list(failed) == [dead]


async def test_a_rank_that_cannot_stage_a_bucket_stops_the_push_instead_of_hanging_it():
    receiver = _Receiver(decode_shared_named_tensors)
    server = await _serve(receiver)
    url = str(server.make_url("")).rstrip("/")
    try:
        results = await _push_from_two_ranks(url, fail_bucket=1)
    finally:
        await server.close()
    # Bucket 0 reached the engine; bucket 1 was never posted; both ranks name the cause.
    assert len(receiver.requests) == 1
    for _, failed, _ in results:
        assert "no room for the staging buffer" in failed[url]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC handles need a GPU")
async def test_on_a_gpu_the_payloads_are_cuda_ipc_handles_naming_the_gpu_by_uuid():
    """Both ranks on one GPU (the device has one): each payload opens as CUDA memory of that GPU,
    found by its UUID, with the trainer's values."""
    from rlkube_runtime.engine.weights import gpu_uuid

    receiver = _Receiver(decode_shared_named_tensors)
    server = await _serve(receiver)
    try:
        results = await _push_from_two_ranks(str(server.make_url("")).rstrip("/"), device="cuda")
    finally:
        await server.close()
    assert [(position, failed) for position, failed, _ in results] == [(0, {}), (1, {})]
    _check_every_bucket_came_from_both_ranks_in_order(receiver)
    # The handles name the GPU by UUID (an engine's rank sees it under another index).
    assert gpu_uuid(0).encode() in base64.b64decode(receiver.requests[0]["raw"][1])
