"""Weight sync into a colocated engine over several GPUs, in memory: what the handle exchange costs.

An engine over k GPUs takes one /update_weights_from_tensor payload per tensor-parallel rank; the
k trainer ranks on its GPUs stage each bucket on their GPU and the first posts all k payloads
(`weight_sync.HandleGroup`). Here k trainer-rank processes share one GPU (the device has one) and
push the Qwen3-0.6B-shaped weights (bf16, 128 MiB buckets) to a receiver process that opens
every payload as the built-in engine does (`decode_shared_named_tensors`, CUDA IPC by GPU UUID)
and copies each tensor into its own GPU memory, as SGLang's TP rank i copies its shard of payload
i (here the whole tensor: an upper bound on the engine's copy). k = 1 is today's one-rank push.

Reported per k: seconds per sync (median of the repeats, after one warm-up), bytes each rank
stages and the engine copies, requests, and each rank's peak staging memory.

    python benchmarks/weight_handle_groups.py --ranks 1,2 --out benchmarks/results/weight_handle_groups_h200.md
CPU plumbing check (shared memory in place of CUDA IPC, the tiny shape):
    python benchmarks/weight_handle_groups.py --tiny-shape --device cpu --ranks 1,2 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import command_line, loadavg, write_results  # noqa: E402
from qwen3_shape import QWEN3_06B, TINY, qwen3_config  # noqa: E402

TIMEOUT = datetime.timedelta(minutes=5)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    shape = TINY if args.tiny_shape else QWEN3_06B
    results = {}
    for k in args.ranks:
        results[k] = asyncio.run(_measure(k, args, shape))
        print(json.dumps({"ranks": k, **results[k]}), flush=True)
    command = command_line(__file__, argv)
    figures = {"shape": "tiny" if args.tiny_shape else "qwen3-0.6b", "device": args.device, "results": results,
               "machine": _machine(args.device)}
    write_results(_render(figures, command), figures, command, out=args.out, json_path=args.json)
    return 0


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny-shape", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--json")
    return parser.parse_args(argv)


async def _measure(k: int, args, shape: dict) -> dict:
    import torch.distributed as dist

    context = multiprocessing.get_context("spawn")
    to_engine, from_engine = context.Queue(), context.Queue()
    engine = context.Process(target=_engine_process, args=(args.device, shape, to_engine, from_engine))
    engine.start()
    port = await asyncio.to_thread(from_engine.get, timeout=TIMEOUT.total_seconds())
    store = dist.TCPStore("127.0.0.1", 0, k + 1, True, timeout=TIMEOUT, wait_for_workers=False)
    out = context.Queue()
    ranks = [context.Process(target=_rank_process, args=(p, k, store.port, f"http://127.0.0.1:{port}", args, shape, out))
             for p in range(k)]
    for rank in ranks:
        rank.start()
    try:
        reports = sorted([await asyncio.to_thread(out.get, timeout=TIMEOUT.total_seconds() * 2) for _ in ranks])
    finally:
        to_engine.put("stop")
        await _reap([*ranks, engine])
    leader = reports[0][1]
    return {
        "seconds": statistics.median(leader["seconds"][1:]) if len(leader["seconds"]) > 1 else leader["seconds"][0],
        "seconds_each": leader["seconds"],
        "bytes_per_rank": leader["bytes"],
        "requests": leader["requests"],
        "staging_peak_bytes": [r["staging_peak"] for _, r in reports],
    }


async def _reap(processes, timeout_s: float = 60) -> None:
    """Wait for the processes to exit (polling: Process.join waits on a pipe that a rank's
    torch_shm_manager inherits and holds for a minute), killing what is left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _rank_process(position: int, k: int, port: int, url: str, args, shape: dict, out) -> None:
    """One trainer rank: the model's weights in bf16 on the device, pushed `repeat` + 1 times."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3ForCausalLM

    from rlkube_runtime.weight_sync import HandleGroup, WeightSender

    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = Qwen3ForCausalLM(qwen3_config(shape)).to(torch.bfloat16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    store = dist.TCPStore("127.0.0.1", port, k + 1, False, timeout=TIMEOUT)
    handles = HandleGroup(store, engine=0, position=position, size=k, timeout=TIMEOUT) if k > 1 else None
    sender = WeightSender(model, dtype=dtype, bucket_bytes=args.bucket_mb << 20, device=device)
    seconds, report = [], None
    for attempt in range(args.repeat + 1):
        started = time.monotonic()
        report = sender.push([url], transport="tensor", version=f"v{attempt}", handles=handles)
        seconds.append(time.monotonic() - started)
        if report.failed:
            raise RuntimeError(f"rank {position}: {report.failed}")
    staging = sender._staging.numel() * sender._staging.element_size() if sender._staging is not None else 0
    out.put((position, {"seconds": seconds, "bytes": report.bytes_per_engine, "requests": report.requests_per_engine,
                        "staging_peak": staging}))


def _engine_process(device_name: str, shape: dict, inbox, outbox) -> None:
    """The engine's side: /update_weights_from_tensor opening payload i as TP rank i and copying
    each tensor into weights of its own (allocated at the first sight of each name)."""
    import torch
    from aiohttp import web

    from rlkube_runtime.engine.weights import decode_shared_named_tensors

    device = torch.device(device_name)
    weights: dict[tuple[int, str], torch.Tensor] = {}

    async def update(request):
        body = await request.json()
        for i, payload in enumerate(body["serialized_named_tensors"]):
            for name, tensor in decode_shared_named_tensors(payload, field=f"serialized_named_tensors[{i}]"):
                target = weights.get((i, name))
                if target is None:
                    target = weights[(i, name)] = torch.empty_like(tensor, device=device)
                target.copy_(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return web.json_response({"success": True, "message": "ok"})

    async def serve():
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/update_weights_from_tensor", update)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        outbox.put(site._server.sockets[0].getsockname()[1])
        await asyncio.to_thread(inbox.get)
        await runner.cleanup()

    asyncio.run(serve())


def _machine(device: str) -> dict:
    import torch

    info = {"loadavg": loadavg(), "torch": torch.__version__}
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _render(figures: dict, command: str) -> str:
    rows = ["| ranks on the engine's GPUs | seconds per sync | bytes each rank stages | requests | staging per rank |",
            "|---|---|---|---|---|"]
    for k, r in figures["results"].items():
        rows.append(f"| {k} | {r['seconds']:.3f} | {r['bytes_per_rank'] / 1e9:.3f} GB | {r['requests']} | "
                    f"{max(r['staging_peak_bytes']) / 2**20:.0f} MiB |")
    return "\n".join([
        "# Weight sync into an engine over several GPUs, through per-rank CUDA IPC handles",
        "",
        f"Command: `{command}`",
        "",
        f"Shape {figures['shape']}, device {figures['device']}, machine {json.dumps(figures['machine'])}.",
        "Every rank of one engine stages each bucket on its GPU and the leader posts one payload per rank; the",
        "receiver opens every payload and copies all of its tensors (an upper bound on an engine's TP shard copy).",
        "Seconds: median over the repeats after one warm-up push (each push in the JSON).",
        "",
        *rows,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
