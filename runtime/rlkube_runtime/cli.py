"""The `rlkube` command: one entry point, each subcommand a thin call into the module that owns it.

Imports happen inside each subcommand so `rlkube validate` never pays for torch or ray.
"""

from __future__ import annotations

import argparse
import sys


def _validate(args: argparse.Namespace) -> int:
    from rlkube_runtime.spec.pod_policy import DEFAULT_POLICY, load_pod_policy
    from rlkube_runtime.spec.validate import validate_files

    try:
        policy = load_pod_policy(args.policy) if args.policy else DEFAULT_POLICY
    except ValueError as err:
        print(f"rlkube validate: {err}", file=sys.stderr)
        return 2
    return validate_files(args.files, policy=policy, namespace=args.namespace)


def _crd(args: argparse.Namespace) -> int:
    from rlkube_runtime.spec.crd import render_crd_yaml

    text = render_crd_yaml()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _run(args: argparse.Namespace) -> int:
    from rlkube_runtime.run import run_from_file

    if args.debug_rollout_only and args.debug_train_only:
        print("rlkube run: --debug-rollout-only and --debug-train-only exclude each other", file=sys.stderr)
        return 2
    mode = "rollout-only" if args.debug_rollout_only else "train-only" if args.debug_train_only else "train"
    return run_from_file(
        args.file,
        output_dir=args.output_dir,
        resume=not args.no_resume,
        mode=mode,
        load_rollouts=args.load_rollouts,
        dump_all_rollouts=args.dump_all_rollouts,
    )


def _convert(args: argparse.Namespace) -> int:
    from rlkube_runtime.trainer.megatron import offline

    try:
        if args.direction == "hf-to-megatron":
            out = offline.hf_to_megatron(args.hf, args.out, tensor=args.tensor, pipeline=args.pipeline)
        else:
            out = offline.megatron_to_hf(args.checkpoint, args.hf_config, args.out)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as err:
        print(f"rlkube convert {args.direction}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _render(args: argparse.Namespace) -> int:
    from rlkube_operator import preview

    return preview.run(args)


def _operator(args: argparse.Namespace) -> int:
    from rlkube_operator.main import run_operator

    return run_operator(namespace=args.namespace, standalone=args.standalone, metrics_port=args.metrics_port)


def _stop_driver(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from rlkube_runtime.run.stop import stop_driver
    from rlkube_runtime.spec.contract import DRIVER_PID_FILE, ENV_DRIVER_PID_FILE

    print(stop_driver(Path(args.pid_file or os.environ.get(ENV_DRIVER_PID_FILE) or DRIVER_PID_FILE)), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkube", description="RL post-training as Kubernetes custom resources.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="validate RLJob YAML files (one or many documents each)")
    p.add_argument("files", nargs="+")
    p.add_argument("--policy", default=None, help="the cluster's pod policy: the chart's values file or the "
                   "operator's policy file (default: nothing beyond the safe volumes, no Secrets but secretEnv)")
    p.add_argument("--namespace", default=None, help="namespace of documents that name none, for the policy")
    p.set_defaults(func=_validate)

    p = sub.add_parser("render", help="print every object the operator would create for RLJob files, for review "
                       "before kubectl apply")
    p.add_argument("files", nargs="+")
    p.add_argument("--attempt", type=int, default=0, help="attempt number of the RayJob (default 0)")
    p.add_argument("--namespace", default=None, help="namespace of documents that name none (default: default)")
    p.add_argument("--policy", default=None, help="the cluster's pod policy: the chart's values file or the "
                   "operator's policy file (default: the operator's RLKUBE_POD_POLICY, else the default)")
    p.set_defaults(func=_render)

    p = sub.add_parser("crd", help="print the RLJob CustomResourceDefinition generated from the typed spec")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=_crd)

    p = sub.add_parser("run", help="run an RLJob locally (Ray local mode, built-in engine)")
    p.add_argument("file")
    p.add_argument("--output-dir", default=None, help="where checkpoints and logs go (default: spec.model.save or ./runs/<name>)")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints and start fresh")
    p.add_argument("--dump-all-rollouts", action="store_true",
                   help="dump every sample of every rollout to <output>/rollouts/ (default: spec.observability.rolloutDump)")
    p.add_argument("--debug-rollout-only", action="store_true",
                   help="generate and dump every rollout, no trainer, no training, no checkpoints")
    p.add_argument("--debug-train-only", action="store_true",
                   help="train on the rollouts dumped in --load-rollouts DIR, no engines, no checkpoints")
    p.add_argument("--load-rollouts", metavar="DIR", default=None,
                   help="with --debug-train-only: the rollout_<k>.jsonl dumps to train on (a run's <output>/rollouts)")
    p.set_defaults(func=_run)

    p = sub.add_parser("stop-driver", help="SIGTERM this pod's `rlkube run` driver and wait until it has saved a "
                       "checkpoint and exited (the Ray head pod's preStop hook)")
    p.add_argument("--pid-file", default=None, help="the driver's pid file (default: $RLKUBE_DRIVER_PID_FILE, "
                   "else the head pod's)")
    p.set_defaults(func=_stop_driver)

    p = sub.add_parser("convert", help="convert weights between HF directories and megatron distributed checkpoints")
    conv = p.add_subparsers(dest="direction", required=True)
    c = conv.add_parser("hf-to-megatron", help="shard an HF checkpoint into a megatron-core distributed checkpoint")
    c.add_argument("--hf", required=True, help="HF model directory (config.json, safetensors)")
    c.add_argument("--out", required=True, help="new (or empty) directory for the distributed checkpoint")
    c.add_argument("--tensor", type=int, default=1, help="tensor-parallel size to shard for (default 1)")
    c.add_argument("--pipeline", type=int, default=1, help="pipeline-parallel size to shard for (default 1)")
    c.set_defaults(func=_convert)
    c = conv.add_parser("megatron-to-hf", help="write an HF directory from a megatron distributed checkpoint")
    c.add_argument("--checkpoint", required=True,
                   help="distributed checkpoint directory, a trainer checkpoint (rollout_*), or a checkpoint root")
    c.add_argument("--hf-config", required=True, help="HF directory whose config and tokenizer describe the model")
    c.add_argument("--out", required=True, help="where the HF directory goes")
    c.set_defaults(func=_convert)

    p = sub.add_parser("operator", help="run the RLJob operator (kopf)")
    p.add_argument("--namespace", default=None, help="watch one namespace (default: all)")
    p.add_argument("--standalone", action="store_true", help="no peering with other operator instances")
    p.add_argument("--metrics-port", type=int, default=8080)
    p.set_defaults(func=_operator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
