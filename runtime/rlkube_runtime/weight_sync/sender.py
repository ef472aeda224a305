"""Pushing a trainer rank's weights into rollout engines (SGLang servers or the built-in engine).

Transports, each in SGLang's own API shapes so one sender drives either kind of engine:
- `tensor`: /update_weights_from_tensor with SGLang's default format, pickled (name, tensor)
  handles to a staging buffer: CUDA IPC on a GPU shared with the engine (colocated placement),
  file-backed shared memory on a CPU. The engine copies straight out of the trainer's memory.
  An engine over several GPUs takes one payload per GPU: the trainer ranks on them stage each
  bucket together and one posts all of them (`handle_group.HandleGroup`).
- `distributed`: /init_weights_update_group once per engine (a two-rank NCCL group, or gloo on a
  CPU), then per bucket /update_weights_from_distributed (names, dtypes, shapes) while this rank
  broadcasts the same tensors (separate placement).
- `http`: /update_weights_from_tensor with the `rlkube_safetensors` format: the bytes themselves,
  one request per bucket, large tensors split into blocks of rows (built-in engines only).
- `disk`: an HF directory on storage the engines share, then /update_weights_from_disk.
- `adapter` (spec.training.lora): the LoRA adapter alone as a peft directory on that storage, then
  /unload_lora_adapter and /load_lora_adapter under one name (`lora.ADAPTER_NAME`, which generation
  requests ask for) and /update_weight_version.

Weights travel in the engines' dtype (bf16 from fp32 master weights halves the bytes), tied
tensors once, in buckets of at most `bucket_bytes`. With `quantization="fp8"` (spec.model.rolloutDtype
fp8) the decoder layers' linear weights are quantized on this rank's device while staged and go as
`name` (float8_e4m3fn, 128x128 blocks) plus `name_scale_inv` (float32), the rest in the engines'
dtype (rlkube_runtime/fp8.py); one staging buffer of bytes holds a bucket's tensors of every dtype.
The engines are paused and flushed by the rollout manager before a push and resumed after it;
the weight version is set with the last bucket, so an engine never reports a version it has
only half loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from rlkube_runtime.memory import unique_named_tensors
from rlkube_runtime import fp8, lora
from rlkube_runtime.weight_sync.buckets import Piece, plan_buckets
from rlkube_runtime.weight_sync.coordinator import SyncReport
from rlkube_runtime.weight_sync.handle_group import HandleGroup, HandleGroupError
from rlkube_runtime.weight_sync.plan import TRANSPORTS

log = logging.getLogger(__name__)

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
QUANTIZATIONS = (None, "fp8")
# Where each tensor of a bucket starts in the byte staging buffer: a multiple of this (every
# dtype's itemsize divides it, and CUDA kernels like 16-byte aligned rows).
STAGING_ALIGN = 256


@dataclasses.dataclass
class _Group:
    name: str
    store: Any
    group: Any


class WeightSender:
    """One per trainer rank that pushes weights; keeps its staging buffer and its process groups
    (one per engine URL) for the run.

    model: the trainer's module (weights on the training device or offloaded to the CPU).
    device: where staging buffers live (the rank's GPU, or the CPU).
    save_hf: writes an HF directory of the current weights (the `disk` transport).
    engine_ranks: GPUs (tensor-parallel ranks) per engine; a `distributed` group has this rank
    plus all of them.
    quantization: None, or "fp8": the decoder layers' linear weights go as e4m3 + block scales.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype,
        bucket_bytes: int,
        device: torch.device,
        node_ip: str = "127.0.0.1",  # local only (tests); the trainer passes its node's IP
        save_hf: Callable[[str], Any] | None = None,
        save_adapter: Callable[[str], Any] | None = None,
        engine_ranks: int = 1,
        quantization: str | None = None,
    ):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
        self.model = model
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.node_ip = node_ip
        self._save_hf = save_hf
        self._save_adapter = save_adapter
        self.engine_ranks = engine_ranks
        self._groups: dict[str, _Group] = {}
        self.quantization = quantization
        self._staging: torch.Tensor | None = None  # bytes (uint8): each staged tensor a view into it

    def push(self, urls: Sequence[str], *, transport: str, version: str, disk_dir: str | None = None,
             handles: HandleGroup | None = None) -> SyncReport:
        """Load the current weights into every engine in `urls`; engines that fail are listed in
        the report (their groups dropped) rather than stopping the others. `handles`: for
        `tensor` into one engine over several GPUs, this rank's place among the ranks on them
        (every one of them calls push; the leader alone talks to the engine)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"weight-sync transport must be one of {list(TRANSPORTS)}, got {transport!r}")
        started = time.monotonic()
        report = SyncReport(transport=transport, version=version)
        if transport == "disk":
            if self.quantization is not None:
                raise ValueError(f"the disk transport writes the HF directory unquantized; quantization "
                                 f"{self.quantization!r} goes by 'tensor', 'distributed' or 'http'")
            asyncio.run(self._push_disk(list(urls), version, disk_dir, report))
        elif transport == "adapter":
            asyncio.run(self._push_adapter(list(urls), version, disk_dir, report))
        else:
            named = dict(unique_named_tensors(self.model))
            split = transport == "http"
            buckets = plan_buckets(
                [(n, tuple(t.shape)) for n, t in named.items()],
                itemsize=self.dtype.itemsize,
                itemsizes={n: t.element_size() for n, t in named.items() if not t.is_floating_point()},
                quantized=self._quantized(named),
                bucket_bytes=self.bucket_bytes,
                split_rows=split,
            )
            report.bytes_per_engine = sum(p.nbytes for b in buckets for p in b)
            report.requests_per_engine = len(buckets)
            push = {"tensor": functools.partial(self._push_tensor, handles=handles),
                    "distributed": self._push_distributed, "http": self._push_http}[transport]
            asyncio.run(push(list(urls), named, buckets, version, report))
        report.seconds = time.monotonic() - started
        return report

    def _quantized(self, named: dict[str, torch.Tensor]) -> frozenset[str]:
        """The names this push sends as e4m3 + block scales."""
        if self.quantization != "fp8":
            return frozenset()
        return frozenset(n for n, t in named.items() if t.is_floating_point() and fp8.is_quantized_name(n, t.shape))

    def close(self) -> None:
        for url in list(self._groups):
            self._drop_group(url)

    # ---- transports ----------------------------------------------------------------------

    async def _push_http(self, urls, named, buckets, version, report: SyncReport) -> None:
        from rlkube_runtime.engine.weights import encode_named_tensors

        admins = _admins(urls)
        try:
            for i, bucket in enumerate(buckets):
                tensors, offsets = {}, {}
                for piece in bucket:
                    for name, tensor, offset in self._transfer_tensors(named, piece):
                        tensors[name] = tensor.to("cpu")
                        if offset is not None:
                            offsets[name] = offset
                payload = await asyncio.to_thread(encode_named_tensors, tensors, offsets)
                last = i == len(buckets) - 1
                live = [u for u in urls if u not in report.failed]
                results = await asyncio.gather(
                    *(admins[u].update_weights_from_tensor([payload], load_format="rlkube_safetensors",
                                                            version=version if last else None, flush_cache=last)
                      for u in live),
                    return_exceptions=True,
                )
                _record_failures(live, results, report)
        finally:
            await _close(admins)

    async def _push_tensor(self, urls, named, buckets, version, report: SyncReport, handles: HandleGroup | None = None) -> None:
        if handles is not None and handles.size > 1:
            if len(urls) != 1:
                raise ValueError(f"a handle group serves one engine, got {len(urls)} URLs")
            await self._push_tensor_shared(urls[0], named, buckets, version, report, handles)
            return
        admins = _admins(urls)
        try:
            for url in urls:
                for i, bucket in enumerate(buckets):
                    payload = self._staged_handles(named, bucket)  # per engine: a CPU handle opens once
                    last = i == len(buckets) - 1
                    try:
                        await admins[url].update_weights_from_tensor(
                            [payload], load_format=None, version=version if last else None, flush_cache=last
                        )
                    except Exception as err:  # this engine failed; the others still get their weights
                        report.failed[url] = f"{type(err).__name__}: {err}"
                        break
        finally:
            await _close(admins)

    async def _push_tensor_shared(self, url, named, buckets, version, report: SyncReport, handles: HandleGroup) -> None:
        """One bucket at a time, every rank of `handles` stages it on its GPU; the leader posts
        the payloads (one per tensor-parallel rank of the engine) and tells the members when the
        engine has copied them, so that they may stage the next bucket over the same buffer."""
        admins = _admins([url]) if handles.leader else {}  # the members talk to the leader only
        try:
            for i, bucket in enumerate(buckets):
                try:
                    payload = self._staged_handles(named, bucket)
                except Exception as err:  # the leader must hear of it, or it waits for this payload
                    payload = HandleGroup.failure(f"trainer rank {handles.position} of engine {handles.engine}: "
                                                  f"{type(err).__name__}: {err}")
                try:
                    if not handles.leader:
                        await asyncio.to_thread(handles.offer, version, i, payload)
                        continue
                    payloads = await asyncio.to_thread(handles.collect, version, i, payload)
                except HandleGroupError as err:
                    report.failed[url] = str(err)
                    return
                last = i == len(buckets) - 1
                try:
                    await admins[url].update_weights_from_tensor(
                        payloads, load_format=None, version=version if last else None, flush_cache=last
                    )
                except Exception as err:
                    report.failed[url] = f"{type(err).__name__}: {err}"
                    await asyncio.to_thread(handles.announce, version, i, report.failed[url])
                    return
                await asyncio.to_thread(handles.announce, version, i)
        finally:
            await _close(admins)

    def _staged_handles(self, named, bucket: list[Piece]) -> str:
        """One bucket staged (and finished on the GPU) as SGLang's default-format payload."""
        from rlkube_runtime.engine.weights import encode_shared_named_tensors

        pairs = self._stage(named, bucket)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return encode_shared_named_tensors(pairs)

    async def _push_distributed(self, urls, named, buckets, version, report: SyncReport) -> None:
        admins = _admins(urls)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            for url in urls:
                try:
                    group = await self._group(url, admins[url])
                    for i, bucket in enumerate(buckets):
                        staged = self._stage(named, bucket)
                        last = i == len(buckets) - 1

                        def broadcast(staged=staged) -> None:
                            # e4m3 as its bytes: gloo has no float8 type (the receiver takes the
                            # same bytes into a float8 tensor).
                            for work in [group.group.broadcast([_as_broadcastable(view)], options) for _, view in staged]:
                                work.wait()

                        await asyncio.gather(
                            admins[url].update_weights_from_distributed(
                                names=[name for name, _ in staged],
                                dtypes=[str(view.dtype).removeprefix("torch.") for _, view in staged],
                                shapes=[list(view.shape) for _, view in staged],
                                group_name=group.name,
                                version=version if last else None,
                                flush_cache=last,
                            ),
                            asyncio.to_thread(broadcast),
                        )
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                except Exception as err:  # this engine failed; its group is unusable now
                    report.failed[url] = f"{type(err).__name__}: {err}"
                    self._drop_group(url)
        finally:
            await _close(admins)

    async def _push_disk(self, urls, version: str, disk_dir: str | None, report: SyncReport) -> None:
        if self._save_hf is None or disk_dir is None:
            raise ValueError("the disk transport needs save_hf and a directory the engines can read")
        path = str(Path(disk_dir) / f"v{version}")
        await asyncio.to_thread(self._save_hf, path)
        report.bytes_per_engine = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        report.requests_per_engine = 1
        admins = _admins(urls)
        try:
            results = await asyncio.gather(
                *(admins[u].update_weights_from_disk(path, version=version) for u in urls), return_exceptions=True
            )
            _record_failures(urls, results, report)
        finally:
            await _close(admins)
        prune_older_versions(Path(disk_dir), keep=Path(path))

    async def _push_adapter(self, urls, version: str, disk_dir: str | None, report: SyncReport) -> None:
        """Write the adapter, then in every engine replace the one it serves and set the version.
        Unloading fails on an engine that has none yet (a new or restarted one): that is fine."""
        if self._save_adapter is None or disk_dir is None:
            raise ValueError("the adapter transport needs save_adapter and a directory the engines can read")
        path = Path(disk_dir) / f"lora-v{version}"
        await asyncio.to_thread(self._save_adapter, str(path))
        report.bytes_per_engine = lora.adapter_bytes(path)
        report.requests_per_engine = 3
        admins = _admins(urls)

        from rlkube_runtime.serving.client import EngineHTTPError

        async def replace(admin):
            with contextlib.suppress(EngineHTTPError):
                await admin.unload_lora_adapter(lora.ADAPTER_NAME)
            await admin.load_lora_adapter(lora.ADAPTER_NAME, str(path))
            await admin.update_weight_version(version)

        try:
            results = await asyncio.gather(*(replace(admins[u]) for u in urls), return_exceptions=True)
            _record_failures(urls, results, report)
        finally:
            await _close(admins)
        prune_older_versions(Path(disk_dir), keep=path, pattern="lora-v*")

    # ---- helpers -------------------------------------------------------------------------

    async def _group(self, url: str, admin) -> _Group:
        """This engine's two-rank group, created on first use (rank 0 here, rank 1 there)."""
        if url in self._groups:
            return self._groups[url]
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        world = 1 + self.engine_ranks
        # Port 0: the OS picks a free one, nothing can take it between choosing and binding.
        store = dist.TCPStore(self.node_ip, 0, world, True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        name = f"rlkube-{uuid.uuid4().hex[:12]}"

        def make_group():
            if backend == "nccl":
                return dist.ProcessGroupNCCL(store, 0, world, GROUP_TIMEOUT)
            return dist.ProcessGroupGloo(store, 0, world, GROUP_TIMEOUT)  # waits for the engine to join

        building = asyncio.ensure_future(asyncio.to_thread(make_group))
        try:
            await admin.init_weights_update_group(
                master_address=self.node_ip, master_port=store.port, rank_offset=1, world_size=world, group_name=name,
                backend=backend,
            )
        except BaseException:
            if backend == "gloo":
                # Our gloo join waits for peers that will not come: stand in for them, so the
                # join returns now instead of at the group timeout.
                await asyncio.gather(*(
                    asyncio.to_thread(dist.ProcessGroupGloo, _store_client(self.node_ip, store.port, world), rank, world, GROUP_TIMEOUT)
                    for rank in range(1, world)
                ))
            await asyncio.gather(building, return_exceptions=True)
            raise
        group = await building
        self._groups[url] = _Group(name=name, store=store, group=group)
        return self._groups[url]

    def _drop_group(self, url: str) -> None:
        group = self._groups.pop(url, None)
        if group is not None and hasattr(group.group, "abort"):
            try:
                group.group.abort()  # a half-done NCCL broadcast must not spin on the GPU forever
            except Exception as err:  # the group is being dropped either way
                log.warning("aborting the weight group of %s failed: %s", url, err)

    def _stage(self, named: dict[str, torch.Tensor], bucket: list[Piece]) -> list[tuple[str, torch.Tensor]]:
        """Copy one bucket into the staging buffer, each tensor in its transfer dtype (the engines'
        dtype; integer buffers their own; quantized weights e4m3 and their scales float32) at an
        aligned offset of the buffer's bytes: [(name, view)]."""
        layout, total = [], 0
        for piece in bucket:
            for name, shape, dtype in self._outputs(named, piece):
                layout.append((piece, name, shape, dtype, total))
                total += -(-math.prod(shape) * dtype.itemsize // STAGING_ALIGN) * STAGING_ALIGN
        buffer = self._buffer(total)
        staged = []
        quantized: dict[Piece, tuple[torch.Tensor, torch.Tensor]] = {}
        for piece, name, shape, dtype, offset in layout:
            view = buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            source = _piece_of(named[piece.name], piece).detach()
            if piece.quantized:
                if piece not in quantized:  # on this rank's device, in float32
                    quantized[piece] = fp8.quantize_blockwise(source.to(self.device, non_blocking=True))
                q, scale = quantized[piece]
                view.copy_(q if dtype == fp8.FP8_DTYPE else scale)
            else:
                view.copy_(source, non_blocking=True)
            staged.append((name, view))
        return staged

    def _outputs(self, named: dict[str, torch.Tensor], piece: Piece) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What `piece` goes out as: [(name, shape, dtype)]."""
        source = named[piece.name]
        if piece.quantized:
            return [(piece.name, piece.shape, fp8.FP8_DTYPE),
                    (fp8.scale_name(piece.name), fp8.scale_shape(piece.shape), torch.float32)]
        return [(piece.name, piece.shape, self.dtype if source.is_floating_point() else source.dtype)]

    def _transfer_tensors(self, named, piece: Piece) -> list[tuple[str, torch.Tensor, int | None]]:
        """`piece` as the tensors that travel (not staged; the `http` transport's), each with the
        first row it fills (None: the whole tensor). A quantized piece is quantized on this rank's
        device; its rows start at a block boundary, so its scales are rows start/128 on."""
        source = _piece_of(named[piece.name], piece).detach()
        start = piece.rows[0] if piece.rows is not None else None
        if piece.quantized:
            q, scale = fp8.quantize_blockwise(source.to(self.device))
            return [(piece.name, q, start),
                    (fp8.scale_name(piece.name), scale, None if start is None else start // fp8.BLOCK[0])]
        return [(piece.name, self._cast(source, torch.device("cpu")), start)]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None
            self._staging = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            if self.device.type == "cpu":
                # Shared memory named by a file: any process of this machine can open it. (The
                # default passes file descriptors over a socket authenticated with a key that
                # only processes forked from this one know.)
                torch.multiprocessing.set_sharing_strategy("file_system")
                self._staging.share_memory_()  # once: every bucket's handle points into it
        return self._staging

    def _cast(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        tensor = tensor.detach()
        return tensor.to(device, self.dtype) if tensor.is_floating_point() else tensor.to(device)


def _as_broadcastable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == fp8.FP8_DTYPE else tensor


def _store_client(host: str, port: int, world: int) -> Any:
    return dist.TCPStore(host, port, world, False, timeout=GROUP_TIMEOUT)


def _piece_of(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    return tensor if piece.rows is None else tensor[piece.rows[0] : piece.rows[1]]


def prune_older_versions(disk_dir: Path, *, keep: Path, pattern: str = "v*") -> None:
    """Delete the `disk` transport's earlier version directories (v<version> beside `keep`; the
    adapter transport's lora-v<version>): every engine, and any replacement, loads the newest, so
    only it is kept (a full HF directory per sync would fill the disk)."""
    import shutil

    for old in disk_dir.glob(pattern):
        if old.is_dir() and old.resolve() != keep.resolve():
            shutil.rmtree(old, ignore_errors=True)


def _admins(urls: Sequence[str]) -> dict[str, Any]:
    from rlkube_runtime.serving.client import EngineAdmin

    # One attempt: a weight request that is retried could wait for a broadcast that never comes.
    return {url: EngineAdmin(url, max_attempts=1) for url in urls}


async def _close(admins: dict[str, Any]) -> None:
    await asyncio.gather(*(a.close() for a in admins.values()), return_exceptions=True)


def _record_failures(urls: Sequence[str], results: Sequence[Any], report: SyncReport) -> None:
    for url, result in zip(urls, results):
        if isinstance(result, BaseException):
            report.failed[url] = f"{type(result).__name__}: {result}"
