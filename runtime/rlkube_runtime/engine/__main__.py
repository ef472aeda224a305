"""`python -m rlkube_runtime.engine --model-path DIR --port P`: the built-in engine as a server."""

from __future__ import annotations

import argparse
import gc
import logging
import os

from aiohttp import web

from rlkube_runtime.engine.engine import Engine, EngineConfig
from rlkube_runtime.engine.routes import build_app


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser(
        prog="python -m rlkube_runtime.engine",
        description="rlkube's built-in rollout engine: SGLang's native HTTP API over a transformers causal LM.",
    )
    parser.add_argument("--model-path", required=True, help="HF checkpoint directory (config, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on; rlkube passes the node's IP (loopback: local only)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--seed", type=int, default=0, help="server seed; sampling streams derive from it")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--max-running-requests", type=int, default=None, help="requests decoded together at most (default 256 on a GPU, 64 on a CPU)"
    )
    parser.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    parser.add_argument("--weight-version", default="default", help="reported until a weight update sets another")
    parser.add_argument(
        "--runner", default="auto", choices=["auto", "slot", "hf"],
        help="slot: static KV cache and CUDA-graph decode (Llama, Mistral, Qwen2, Qwen3); hf: transformers' own forward "
        "(any model); auto (default): slot when the model allows",
    )
    parser.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly on a GPU too")
    parser.add_argument(
        "--enable-torch-compile", action="store_true",
        help="GPU: fuse the decode step's norms, RoPE, SwiGLU and softmax with torch.compile (slower start-up)",
    )
    parser.add_argument("--mem-fraction-static", type=float, default=0.8, help="share of GPU memory for weights and KV cache")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV cache slots at most (default: by the memory share)")
    threads = os.environ.get("RLKUBE_ENGINE_THREADS")
    parser.add_argument(
        "--num-threads", type=int, default=int(threads) if threads else None,
        help="CPU threads for torch (default: $RLKUBE_ENGINE_THREADS, else torch's choice); with several "
        "engines on one machine give each a share",
    )
    parser.add_argument(
        "--quantization", default=None, choices=["fp8"],
        help="fp8: serve block-quantized e4m3 weights (128x128 blocks, as SGLang's fp8): a block-fp8 checkpoint "
        "(config.json's quantization_config) implies it and is read dequantized; otherwise the checkpoint's "
        "decoder-layer linear weights are quantized and dequantized at start, and weight updates send e4m3 "
        "weights with their _scale_inv; computed in --dtype (the weights' quantization error, not fp8 GEMMs)",
    )
    parser.add_argument(
        "--enable-return-routed-experts", action="store_true",
        help="answer requests with return_routed_experts with every token's experts in each layer "
        "(meta_info.routed_experts, as SGLang's flag): mixture-of-experts models, for rollout routing replay",
    )
    parser.add_argument(
        "--enable-lora", action="store_true",
        help="take LoRA adapters with /load_lora_adapter (peft directories, merged into the weights: one at a time) "
        "and serve requests naming it in lora_path (as SGLang's flag)",
    )
    parser.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank (SGLang's flag)")
    parser.add_argument("--lora-target-modules", nargs="+", default=None,
                        help="refuse adapters on other layers (SGLang's flag; default: any)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the Python code the checkpoint ships (its model or tokenizer classes); only for checkpoints you trust",
    )
    parser.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' of every request but /health* and /metrics (as SGLang's --api-key)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads is not None:
        if args.num_threads < 1:
            parser.error(f"--num-threads must be at least 1, got {args.num_threads}")
        import torch

        torch.set_num_threads(args.num_threads)
    if args.max_running_requests is None:
        args.max_running_requests = 256 if args.device.startswith("cuda") else 64
    if args.max_running_requests < 1:
        parser.error(f"--max-running-requests must be at least 1, got {args.max_running_requests}")
    return EngineConfig(
        model_path=args.model_path,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        host=args.host,
        port=args.port,
        weight_version=args.weight_version,
        runner=args.runner,
        cuda_graphs=not args.disable_cuda_graph,
        torch_compile=args.enable_torch_compile,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        trust_remote_code=args.trust_remote_code,
        api_key=args.api_key or None,
        quantization=args.quantization,
        return_routed_experts=args.enable_return_routed_experts,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=tuple(args.lora_target_modules) if args.lora_target_modules else None,
    )


class _RouterProbeFilter(logging.Filter):
    """Drop the traceback aiohttp logs when sglang-router probes a worker for gRPC (an HTTP/2
    preface): the router then falls back to HTTP, so the probe is expected, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and "PRI/Upgrade" in str(error))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.getLogger("aiohttp.server").addFilter(_RouterProbeFilter())
    engine = Engine.load(config)
    # What is loaded by now (torch, transformers, the model: ~400k objects) lives as long as the
    # process. Keep it out of the cyclic GC: a full pass over it took 0.2-0.3 s on CPU, paid by
    # every /flush_cache (so by every weight sync), and ~2 s at exit (so at every engine stop).
    gc.freeze()
    # A short shutdown grace: the router holds keep-alive connections open, and a stopping engine
    # has already answered or aborted every request.
    web.run_app(
        build_app(engine, api_key=config.api_key), host=config.host, port=config.port, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
    )


if __name__ == "__main__":
    main()
