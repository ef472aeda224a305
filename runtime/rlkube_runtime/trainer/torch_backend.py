"""The PyTorch trainer backend: a transformers causal LM, AdamW, data parallelism with DDP.

For tiny and CPU runs (and small GPU runs); Megatron-core is the production backend behind the
same `TrainerBackend` interface. One instance per data-parallel rank. When torch.distributed
is initialised (gloo on CPU, NCCL on GPU) the model is wrapped in DDP and each rank trains a
token-balanced share of every global batch.

Exactness across ranks and micro-batches: `policy_objective` scales each micro-batch's loss by
the GLOBAL sample/token counts, so the global loss is the plain sum of all micro-batch losses
on all ranks. Gradients accumulate over micro-batches (summing), and DDP averages over ranks,
so each rank back-propagates world_size × its loss: the average of those is the global sum.

Precision: parameters, gradients and optimizer state are float32 (master weights); on GPU the
forward runs under autocast in `model.dtype` (bf16 by default); on CPU everything is float32.

Recompute (spec.parallelism.recompute): full checkpoints every decoder layer (transformers'
activation checkpointing): a training forward keeps only each layer's input and the backward
runs the layer again, trading one more forward for the activations. Selective recompute
(attention only) is Megatron's and is refused here.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..algorithms.entropy import log_probs_and_entropy
from .backend import (
    COMPILE_ENV, DTYPES, LogProbs, TrainerBackend, compile_enabled, joined_over_ranks, pick_model, summed_over_ranks,
)
from .batch import TrainBatch, loss_counts
from .config import TrainerConfig
from .optim import make_adamw_and_schedule, step_if_finite, to_cpu
from ..expert_names import per_expert_views
from ..memory import PinnedOffload, unique_named_tensors
from ..spec.backend_rules import TORCH_ROUTING_REPLAY_MESSAGE, TORCH_SELECTIVE_RECOMPUTE_MESSAGE
from .packing import pad_rows, partition_for_ranks
from .rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)


# Without spec.parallelism.maxTokensPerGpu a GPU micro-batch holds up to this many padded tokens:
# on an H200 at the Qwen3-0.6B shape 16k tokens run 9% faster than 8k per token (fewer, larger
# launches) at ~50 GiB peak without compiled layers (benchmarks/results/trainer_profile_h200.md).
GPU_MAX_TOKENS_PER_MICRO_BATCH = 16384

# The trainer state in a checkpoint directory (see TorchBackend.save).
STATE_FILE = "trainer_state.pt"
RNG_DIR = "trainer_rng"

__all__ = ["COMPILE_ENV", "STATE_FILE", "TorchBackend", "compile_decoder_layers", "compile_enabled"]


class TorchBackend(TrainerBackend):
    """`TrainerBackend` on a transformers `AutoModelForCausalLM`.

    device: where this rank computes (default: the current CUDA device when CUDA is available,
    else CPU). Construction seeds torch with `config.seed`, loads the actor from
    `model.hf_checkpoint` and, when the loss needs one, a frozen reference from
    `model.ref_load` (an HF directory) or the same initial weights.
    """

    def __init__(self, config: TrainerConfig, *, device: torch.device | str | None = None) -> None:
        if config.recompute == "selective":
            raise ValueError(f"spec.parallelism.recompute: {TORCH_SELECTIVE_RECOMPUTE_MESSAGE}")
        if config.routing_replay:
            raise ValueError(f"spec.training.routingReplay: {TORCH_ROUTING_REPLAY_MESSAGE}")
        self.config = config
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.compute_dtype = DTYPES[config.model.dtype] if self.device.type == "cuda" else torch.float32
        if self.device.type == "cuda":
            self.default_max_tokens = GPU_MAX_TOKENS_PER_MICRO_BATCH
        torch.manual_seed(config.seed)

        self.model = _load_causal_lm(
            config.model.hf_checkpoint, config.model.attn_implementation, config.model.trust_remote_code
        ).to(self.device)
        # spec.training.lora: peft puts the adapter into self.model's linear layers in place and
        # freezes the rest; self._peft is the wrapper that saves it and switches it off.
        self._peft = _add_lora(self.model, config.lora) if config.lora is not None else None
        if config.recompute == "full":
            _recompute_every_layer(self.model)
        self._compiled = self.device.type == "cuda" and compile_enabled()
        if self._compiled:
            compile_decoder_layers(self.model)
        self._train_module: torch.nn.Module = ResponseLogits(self.model)
        if self.world_size > 1:
            self._train_module = DistributedDataParallel(
                self._train_module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                **_no_forward_buffer_sync(),
            )
        self.ref_model: torch.nn.Module | None = None
        # Under LoRA the reference is the base model: the actor with its adapter switched off.
        if config.loss.needs_ref_model and self._peft is None:
            ref_path = config.model.ref_load or config.model.hf_checkpoint
            self.ref_model = _load_causal_lm(ref_path, config.model.attn_implementation, config.model.trust_remote_code).to(
                self.device
            )
            self.ref_model.requires_grad_(False).eval()
            if self._compiled:
                compile_decoder_layers(self.ref_model)

        self.optimizer, self.schedule = make_adamw_and_schedule(self.model, config)
        self._released = False
        self._offload = PinnedOffload()

    # -- forward passes -------------------------------------------------------------------

    @torch.no_grad()
    def log_probs(
        self, batch: TrainBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> LogProbs:
        self._check_resident("log_probs")
        if model == "ref" and self._peft is not None and self.config.loss.needs_ref_model:
            with self._peft.disable_adapter():
                return self.log_probs(batch, model="actor", with_entropy=with_entropy)
        module = pick_model(model, self.model, self.ref_model)
        was_training = module.training
        module.eval()
        mine = partition_for_ranks(batch.total_lengths, self.world_size)[self.rank]
        local = batch.select(mine)
        results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for group in self._plan(local):
            logp, ent = self._forward(ResponseLogits(module), local.select(group), with_entropy=with_entropy, entropy_grad=False)
            for j, i in enumerate(group):
                results[mine[i]] = (logp[j].float().cpu(), None if ent is None else ent[j].float().cpu())
        module.train(was_training)
        return LogProbs.in_batch_order(joined_over_ranks(results), len(batch), with_entropy=with_entropy)

    def accumulate_gradients(
        self,
        batch: TrainBatch,
        *,
        global_num_samples: int | None = None,
        global_num_tokens: int | None = None,
    ) -> dict[str, float]:
        """Set every parameter's `.grad` to the gradient of the global-batch loss; no step.

        The first half of `train_step`, public so the gradient itself can be inspected. After
        it, `.grad` is identical on every rank (collective, like train_step).
        """
        self._check_resident("train_step")
        loss_cfg = self.config.loss
        num_samples, num_tokens = loss_counts(
            batch, loss_cfg, global_num_samples=global_num_samples, global_num_tokens=global_num_tokens
        )

        local = batch.select(partition_for_ranks(batch.total_lengths, self.world_size)[self.rank])
        plan = self._plan(local)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        if not plan:
            self._backward_nothing()  # this rank's share is empty; DDP still needs its all-reduce
        for k, group in enumerate(plan):
            mb = local.select(group)
            with self._grad_sync(k == len(plan) - 1):
                logp, ent = self._forward(
                    self._train_module, mb, with_entropy=True, entropy_grad=loss_cfg.entropy_coef != 0
                )
                loss, metrics = self.micro_batch_loss(mb, logp, ent, num_samples=num_samples, num_tokens=num_tokens)
                # DDP averages gradients over ranks; the global loss is their sum.
                (loss * self.world_size).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        return {**summed_over_ranks(sums), "num_micro_batches": float(len(plan))}

    def clip_and_step(self) -> float:
        clip = self.config.optimizer.clip_grad
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=clip if clip > 0 else math.inf)
        )
        return step_if_finite(self.optimizer, grad_norm)

    # -- weights out ----------------------------------------------------------------------

    def weights_for_push(self):
        """The live parameters and buffers (every rank holds the whole model), tied tensors once,
        fused MoE experts under their per-expert checkpoint names (the names engines load). Under
        LoRA the HF-named weights with the adapter merged in (the sync itself sends the adapter
        alone: `save_adapter`)."""
        if self._peft is not None:
            return iter(self._merged_weights().items())
        return per_expert_views(unique_named_tensors(self.model))

    def save_adapter(self, directory: str | Path) -> Path:
        """The LoRA adapter in peft's directory format (what /load_lora_adapter reads)."""
        if self._peft is None:
            raise ValueError("save_adapter needs spec.training.lora")
        # The frozen base layers stay out: peft would otherwise save an adapted lm_head whole.
        self._peft.save_pretrained(str(directory), save_embedding_layers=False)
        return Path(directory)

    def _merged_weights(self) -> dict[str, torch.Tensor]:
        """HF-named weights, tied tensors once, each adapted layer as W + scaling * B @ A."""
        from ..lora import merged_weights

        base, adapter = lora_split(dict(unique_named_tensors(self.model)))
        return {**base, **merged_weights(base, adapter, self.config.lora.scaling)}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every state-dict entry, tied tensors under each of their names."""
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self.model.state_dict().items()}

    def save_hf(self, directory: str | Path) -> Path:
        """Config, float32 safetensors and the tokenizer of `hf_checkpoint`.

        Not collective: every rank holds the same weights, so call it on one rank.
        """
        from transformers import AutoTokenizer

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self._peft is not None:  # the merged model, loadable by any engine, and the adapter beside it
            self.save_adapter(directory / "adapter")
            state = {k: v.detach().to("cpu", torch.float32) for k, v in self._merged_weights().items()}
        else:
            state = {k: v.detach().to("cpu", torch.float32) for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(directory, state_dict=state)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                self.config.model.hf_checkpoint, trust_remote_code=self.config.model.trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise RuntimeError(
                f"could not copy the tokenizer of model.hf_checkpoint={self.config.model.hf_checkpoint!r} "
                f"into {directory}: {err}"
            ) from err
        tokenizer.save_pretrained(directory)
        return directory

    def actor_and_reference(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        return self.model, self.ref_model

    # -- checkpoints ----------------------------------------------------------------------

    # In a checkpoint directory: `state_dict()` in STATE_FILE, written by rank 0 (the state is the
    # same on every rank) and read by every rank, and each rank's random streams in RNG_DIR (dropout
    # or any rank-dependent draw makes them differ). The first format: the payload marks none.
    checkpoint_format: str | None = None

    def save(self, directory: str | Path) -> None:
        """Collective in name: rank 0 writes the whole trainer state (weights and Adam moments,
        12 bytes a parameter) straight to `directory`, so it never travels through Ray; every rank
        writes its own random streams beside it."""
        from .checkpoint import save_torch_file

        if self.rank == 0:
            save_torch_file(Path(directory) / STATE_FILE, self.state_dict())
        streams = _rng_file(directory, self.rank, self.world_size)
        streams.parent.mkdir(exist_ok=True)
        save_torch_file(streams, capture_rng_state())

    def load(self, directory: str | Path) -> None:
        """Every rank reads what `save` wrote and takes its own random streams back; from a
        checkpoint of another world size (or one written before ranks saved theirs), rank 0's."""
        self.load_state_dict(torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True))
        mine = _rng_file(directory, self.rank, self.world_size)
        if mine.is_file():
            restore_rng_state(torch.load(mine, map_location="cpu", weights_only=True))

    def state_dict(self) -> dict[str, Any]:
        """CPU copies of model, optimizer, scheduler and this process's RNG state.

        Not collective (call it on one rank): weights and optimizer state are the same on every
        rank. The RNG state is this rank's; `save` writes every rank's streams beside it so each
        rank resumes with its own.
        """
        state = {
            "model": self._trained_state(),
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "scheduler": self.schedule.state_dict(),
            "rng": capture_rng_state(),
        }
        if self.ref_refreshed:  # the initial reference comes from the model directory; a refreshed one from here
            state["ref_model"] = _cpu_copy(self.ref_model)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"model", "optimizer", "scheduler", "rng"} - set(state)
        if missing:
            raise ValueError(f"trainer state lacks {sorted(missing)}; got keys {sorted(state)}")
        self._load_trained_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["scheduler"])
        restore_rng_state(state["rng"])
        if "ref_model" in state and self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"], strict=True)
            self.ref_refreshed = True

    def _trained_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the model: all of it, or under LoRA the adapter alone (the
        base comes from model.hfCheckpoint again)."""
        if self._peft is None:
            return _cpu_copy(self.model)
        return {k: p.detach().to("cpu", copy=True) for k, p in self.model.named_parameters() if p.requires_grad}

    def _load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        if self._peft is None:
            if any(".lora_A." in k for k in state):
                raise ValueError("the checkpoint's model state is a LoRA adapter, and this job trains the whole model "
                                 "(spec.training.lora is unset); resume it with the lora it was trained with")
            self.model.load_state_dict(state, strict=True)
            return
        trained = {k for k, p in self.model.named_parameters() if p.requires_grad}
        if set(state) != trained:
            raise ValueError(
                f"the checkpoint's model state is not this job's LoRA adapter (spec.training.lora): "
                f"missing {sorted(trained - set(state))[:3]}, unexpected {sorted(set(state) - trained)[:3]}"
            )
        self.model.load_state_dict(state, strict=False)

    def refresh_reference(self) -> None:
        if self._peft is not None:
            from ..spec.lora import LORA_REF_UPDATE_MESSAGE

            raise ValueError(f"spec.training.refUpdateInterval: {LORA_REF_UPDATE_MESSAGE}")
        super().refresh_reference()

    # -- colocated placement --------------------------------------------------------------

    def release(self, *, keep_weights: bool = False) -> None:
        """Free gradients; on GPU also move the reference model, the Adam moments and (unless
        `keep_weights`) the actor's weights to pinned host memory.

        Gradients are dropped (they are rebuilt by the next step anyway). On a CPU trainer that
        is all there is to give back: the weights and moments already live in host memory. On
        GPU the tensors move in place (same Parameter objects, so the optimizer and DDP keep
        their references) and the CUDA caching allocator returns its free blocks. DDP's gradient
        buckets (one model-size buffer) stay allocated. `keep_weights` leaves the actor on the
        GPU for a weight sync from device memory; a later call without it moves them too.
        Forward passes raise until `restore`.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type != "cpu":
            host = torch.device("cpu")
            self._move_optimizer_and_ref(host)
            if not keep_weights:
                self._offload.move_module(self.model, "actor", host)
            self._offload.wait(self.device)
            torch.cuda.empty_cache()
        self._released = True

    def restore(self) -> None:
        """Move what `release` offloaded back to the training device."""
        if not self._released:
            return
        if self.device.type != "cpu":
            self._offload.move_module(self.model, "actor", self.device)
            self._move_optimizer_and_ref(self.device)
            self._offload.wait(self.device)
        self._released = False


    # -- helpers --------------------------------------------------------------------------


    def _forward(
        self, module: torch.nn.Module, mb: TrainBatch, *, with_entropy: bool, entropy_grad: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample response log-probs (and entropy) of one micro-batch of padded rows.

        `module` is a `ResponseLogits` (or DDP around one). Returns lists of [R_i] float32
        tensors on `self.device`.
        """
        rows = pad_rows(mb.tokens, device=self.device)
        index = rows.response_index(mb.response_lengths)  # logits at (row, t) predict token t+1
        with self._autocast():
            logits = module(rows.input_ids, *index)  # [ΣR, V]
        targets = rows.input_ids[index[0], index[1] + 1]
        logp, ent = log_probs_and_entropy(
            logits,
            targets,
            self.config.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            compiled=self._compiled,
        )
        split = list(mb.response_lengths)
        return list(logp.split(split)), None if ent is None else list(ent.split(split))

    def _backward_nothing(self) -> None:
        """A zero-loss forward/backward so DDP's all-reduce on the other ranks has a partner."""
        dummy = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        first = torch.zeros(1, dtype=torch.long, device=self.device)
        with self._grad_sync(True), self._autocast():
            logits = self._train_module(dummy, first, first)
        (logits.float().sum() * 0.0).backward()

    def _grad_sync(self, sync: bool):
        if isinstance(self._train_module, DistributedDataParallel) and not sync:
            return self._train_module.no_sync()
        return contextlib.nullcontext()

    def _autocast(self):
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def _move_optimizer_and_ref(self, device: torch.device) -> None:
        if self.ref_model is not None:
            self._offload.move_module(self.ref_model, "ref", device)
        # The optimizer's parameters are the actor's weights: they move with the actor.
        self._offload.move_optimizer(self.optimizer, "optimizer", device)


def _add_lora(model: torch.nn.Module, lora):
    """peft's LoRA layers in `model` (in place) for spec.training.lora; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    if "lm_head" in lora.target_modules and getattr(model.config, "tie_word_embeddings", False):
        from ..spec.lora import LORA_TIED_HEAD_MESSAGE

        raise ValueError(f"spec.training.lora.targetModules: {LORA_TIED_HEAD_MESSAGE}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                        lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def lora_split(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A peft-injected model's tensors as (HF-named base weights, adapter tensors named as peft
    saves them): `x.base_layer.weight` is `x.weight`, `x.lora_A.default.weight` is `x.lora_A.weight`."""
    base, adapter = {}, {}
    for name, tensor in named.items():
        if ".lora_A." in name or ".lora_B." in name:
            module, part, _adapter_name, leaf = name.rsplit(".", 3)
            adapter[f"{module}.{part}.{leaf}"] = tensor
        else:
            base[name.replace(".base_layer.", ".")] = tensor
    return base, adapter


def _cpu_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


class ResponseLogits(torch.nn.Module):
    """A causal LM computing logits only where they are used: at the (rows, cols) positions
    [N] of its [k, L] input, as [N, vocab]. The full [k, L, vocab] tensor (a 150k vocabulary
    makes it larger than the model's activations) is never built. A module of its own so DDP
    wraps the whole computation."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        # No attention mask: rows are right-padded, so causal attention never lets a real token
        # see a pad, and transformers runs plain causal (flash) attention.
        hidden = self.lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.lm.get_output_embeddings()(hidden[rows, cols])


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """torch.compile each decoder layer of an HF causal LM (dynamic shapes); returns how many.

    HF layers run a dozen unfused float32 kernels per RMSNorm, rotary and SwiGLU, and on a GPU
    those elementwise passes, not the matmuls, dominate forward+backward at sub-billion sizes
    (benchmarks/results/trainer_profile_h200.md: 0.7 s of 1.0 s of kernel time). Compiling
    layer by layer fuses them while keeping one graph for all layers (same code, parameters as
    inputs) and leaves the embedding, LM head and loss, which take ragged shapes, eager.
    """
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        log.warning("no decoder layer list found on %s; its layers run eagerly", type(model).__name__)
        return 0
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def _load_causal_lm(path: str, attn_implementation: str, trust_remote_code: bool = False) -> torch.nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM

    # transformers 5 renamed torch_dtype to dtype.
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, **{dtype_kw: torch.float32}
    )


def _recompute_every_layer(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant: the reentrant
    form breaks DDP's gradient hooks and drops gradients when a layer's inputs need none. The RNG
    state is replayed in the recompute, so dropout masks match the first forward."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name from transformers 5 on
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP keyword that stops the buffer broadcast in every forward.

    Ranks run different numbers of micro-batches, so a collective inside forward would pair up
    wrong calls; the buffers (rotary tables) are computed identically on every rank anyway.
    Newer torch names the switch `forward_sync_buffers`; older torch `broadcast_buffers`.
    """
    import inspect

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def _rng_file(directory: str | Path, rank: int, world_size: int) -> Path:
    """Where rank `rank` of `world_size` keeps its random streams: the world size is in the name,
    so ranks of another world size find none and keep rank 0's."""
    return Path(directory) / RNG_DIR / f"rank{rank}-of-{world_size}.pt"
