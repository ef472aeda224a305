"""Spec -> RunPlan: everything that can fail because of the spec, the data or the dumps, checked
before Ray starts, and the frozen plan the rest of the run reads (where it writes, what it starts
from, which mode, where it may resume from)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlkube_runtime.spec import RLJob
from rlkube_runtime.spec.backend_rules import chosen_backend, with_backend
from rlkube_runtime.spec.load import load_rljobs

RunMode = Literal["train", "rollout-only", "train-only"]


class RunError(Exception):
    """A problem found before training starts; the message names the field or the file."""


class InvalidSpec(RunError):
    """The spec asks for something this runtime refuses (the message names the field): another
    attempt would be refused the same way, so on a cluster it is reported for the operator to
    fail the job instead of restarting it. A missing data file stays a plain RunError."""


@dataclass(frozen=True)
class RunPlan:
    job: RLJob
    output_dir: Path
    checkpoint_root: Path
    resume_roots: tuple[Path, ...]  # where to look for a checkpoint, newest first
    model_path: str  # HF directory (or hub id) the trainer and the engines start from
    spec_path: str = ""  # the job file, for the commands the end-of-run summary suggests
    mode: RunMode = "train"
    rollout_dump: str = "sample"  # spec.observability.rolloutDump, or "all" when asked for
    load_rollouts: Path | None = None  # train-only: the dumps to train on
    train_rollout_ids: tuple[int, ...] = ()  # train-only: the dumped rollouts, in order
    backend: tuple[str, str] = ("torch", "")  # the trainer backend and why (spec/backend_rules.py chosen_backend)

    @property
    def spec(self):
        return self.job.spec

    @property
    def trains(self) -> bool:
        return self.mode != "rollout-only"

    @property
    def generates(self) -> bool:
        return self.mode != "train-only"

    @property
    def num_rollout(self) -> int:
        """The rollout count progress is shown against: training.numRollout, or up to the last dump a
        train-only run trains on."""
        return self.train_rollout_ids[-1] + 1 if self.mode == "train-only" else self.spec.training.num_rollout

    @property
    def eval_interval(self) -> int | None:
        return self.spec.eval.interval if self.spec.eval.datasets else None

    @property
    def dump_dir(self) -> Path:
        from rlkube_runtime.rollout_dump import DUMP_DIR

        return self.output_dir / DUMP_DIR

    def sync_due(self, rollout_id: int) -> bool:
        """Whether the weights go to the engines after training `rollout_id`."""
        every = self.spec.training.update_weights_interval
        return (rollout_id + 1) % every == 0 or rollout_id + 1 == self.spec.training.num_rollout

    def save_due(self, rollout_id: int) -> bool:
        """Whether a checkpoint is written after `rollout_id`: every checkpoint.interval rollouts and after the last."""
        interval, num_rollout = self.spec.checkpoint.interval, self.spec.training.num_rollout
        return bool(interval and (rollout_id + 1) % interval == 0) or rollout_id + 1 == num_rollout

    def hf_export_due(self, rollout_id: int) -> bool:
        """Whether the weights trained through `rollout_id` are exported (checkpoint.hfExportInterval)."""
        interval = self.spec.checkpoint.hf_export_interval
        return bool(interval) and (rollout_id + 1) % interval == 0

    @property
    def hf_exports_dir(self) -> Path:
        """Where the periodic HF exports go, one `rollout_<k>` directory each."""
        return self.output_dir / "hf_exports"

    def eval_due(self, rollout_id: int) -> bool:
        """Whether the eval datasets run after `rollout_id` (-1: before the first rollout)."""
        every = self.eval_interval
        return bool(every) and (rollout_id + 1) % every == 0


def prepare_run(
    path: str,
    *,
    output_dir: str | None = None,
    mode: RunMode = "train",
    load_rollouts: str | None = None,
    dump_all_rollouts: bool = False,
) -> RunPlan:
    """Everything that can fail because of the spec, the data or the dumps, checked before Ray starts."""
    if (mode == "train-only") != (load_rollouts is not None):
        raise RunError("--debug-train-only and --load-rollouts DIR go together: train-only trains on the dumps in DIR")
    jobs = load_rljobs(path)
    if len(jobs) != 1:
        raise InvalidSpec(f"{path}: `rlkube run` takes one RLJob per file, found {len(jobs)}")
    job = jobs[0]
    spec = job.spec
    from rlkube_runtime.trainer.support import check_trainer_supports
    from rlkube_runtime.tracking import TrackingError, check_trackers_available

    try:
        check_trackers_available(spec.observability)
    except TrackingError as err:
        raise RunError(str(err)) from None
    train_ids: tuple[int, ...] = ()
    if load_rollouts is not None:
        train_ids = _check_dumps(Path(load_rollouts), spec)
    out = Path(output_dir or spec.model.save or Path("runs") / job.metadata.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_path = _initial_model(job, out)
    model_config = _check_model_fit(spec, model_path)
    backend, backend_reason = chosen_backend(spec, model_config)
    if spec.training.backend != backend:  # auto, chosen by the model: the trainer ranks get it explicitly
        job = job.model_copy(update={"spec": with_backend(spec, backend)})
        spec = job.spec
    try:
        check_trainer_supports(spec)
    except ValueError as err:
        raise InvalidSpec(str(err)) from None
    if mode != "train-only":
        _check_data(job, model_path)
        _check_fp8_source(spec, model_path)
    checkpoint_root = out / "checkpoints"
    resume_roots = (checkpoint_root,) + ((Path(spec.model.load),) if spec.model.load else ())
    # A rollout-only run exists to produce dumps a train-only run can use: every sample.
    dump = "all" if dump_all_rollouts or mode == "rollout-only" else spec.observability.rollout_dump
    return RunPlan(job, out, checkpoint_root, resume_roots, model_path, spec_path=path, mode=mode, rollout_dump=dump,
                   load_rollouts=Path(load_rollouts).resolve() if load_rollouts else None, train_rollout_ids=train_ids,
                   backend=(backend, backend_reason))


def _check_dumps(directory: Path, spec) -> tuple[int, ...]:
    """The dumped rollouts to train on (at most training.numRollout of them); the first is read
    whole so a sample dump or one from another job stops the run now."""
    from rlkube_runtime.rollout_dump import RolloutDumpError, dumped_rollout_ids, load_rollout_dump

    try:
        ids = dumped_rollout_ids(directory)[: spec.training.num_rollout]
        load_rollout_dump(directory, ids[0], expected_samples=spec.samples_per_rollout)
    except (RolloutDumpError, OSError) as err:
        raise RunError(str(err)) from None
    return tuple(ids)


def _initial_model(job: RLJob, out: Path) -> str:
    """The HF checkpoint to start from; the `tiny` preset is built here, seeded, nothing downloaded."""
    model = job.spec.model
    if model.hf_checkpoint:
        return model.hf_checkpoint
    if model.preset == "tiny":
        from rlkube_runtime.spec import builtin_task_name
        from rlkube_runtime.tiny.cache import tiny_checkpoint
        from rlkube_runtime.tiny.task import get_task

        task = builtin_task_name(job.spec.data.prompt_data)
        alphabet = get_task(task).alphabet if task else None
        target = out / "tiny-model"
        if not (target / "config.json").exists():
            tiny_checkpoint(target, alphabet=alphabet, seed=job.spec.training.seed)
        return str(target)
    if model.preset:
        raise InvalidSpec(
            f"spec.model.preset: {model.preset!r} has no built-in weights; known presets: ['tiny']. "
            "For a named architecture give spec.model.hfCheckpoint instead"
        )
    raise InvalidSpec("spec.model: set hfCheckpoint (or preset: tiny); `load` alone has no architecture to start from")


def _check_model_fit(spec, model_path: str) -> dict | None:
    """The parallel sizes against the model's own shape, when its config.json is at hand (returned)."""
    from rlkube_runtime.spec.model_fit import model_fit_violations, read_model_config

    config = read_model_config(model_path)
    violations = model_fit_violations(spec, config) if config is not None else []
    if violations:
        raise InvalidSpec("; ".join(f"spec.{path}: {message}" for path, message in violations))
    return config


def _check_fp8_source(spec, model_path: str) -> None:
    """An fp8 rollout's engines start from a block-fp8 copy of the model: one that cannot be
    made (no safetensors weights) stops the run now, where the directory is at hand."""
    if spec.model.rollout_dtype != "fp8" or not Path(model_path).is_dir():
        return
    from rlkube_runtime.fp8_checkpoint import Fp8CheckpointError, check_source

    try:
        check_source(model_path)
    except Fp8CheckpointError as err:
        raise InvalidSpec(f"spec.model.rolloutDtype: fp8: {err}") from None


def _check_data(job: RLJob, model_path: str) -> None:
    """Load the prompt set once so a missing file or a bad line stops the run now, not mid-rollout."""
    from rlkube_runtime.data.dataset import DatasetError, load_prompt_dataset_from_spec
    import rlkube_runtime.tiny.task  # noqa: F401  (registers the builtin: prompt sets)

    tokenizer = None
    if job.spec.data.apply_chat_template:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=job.spec.model.trust_remote_code)
    try:
        load_prompt_dataset_from_spec(job.spec.data, tokenizer=tokenizer)
        for dataset in job.spec.eval.datasets:
            load_prompt_dataset_from_spec(dataset.data_spec(job.spec.data), tokenizer=tokenizer)
    except (DatasetError, FileNotFoundError, OSError) as err:
        raise RunError(f"spec.data.promptData: {err}") from None
