"""`python -m rlkube_runtime.serving.router_main [sglang-router flags]`: the real sglang-router (its
Rust `Router`), started as its own launcher `python -m sglang_router.launch_router` starts it, with
the same flags parsed by the same `RouterArgs`.

Why not that launcher: it imports its Python debugging balancer (`mini_lb`) first, and that imports
SGLang's server package: 2 s of CPU at every router start (every run, every rollout pod) for a
mode rlkube never runs. Asked for that mode, this one says so instead.
"""

from __future__ import annotations

import argparse
import sys

from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse_router_args(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser(prog="python -m rlkube_runtime.serving.router_main",
                                     description="sglang-router's Rust router, as sglang_router.launch_router starts it")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb is sglang-router's Python debugging balancer, which rlkube does not run; "
                     "remove mini-lb from spec.rollout.routerArgs")
    return args


def main(argv: list[str] | None = None) -> None:
    import setproctitle

    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    setproctitle.setproctitle("sglang::router")  # what the upstream launcher names the process
    args._validate_router_args()
    Router.from_args(args).start()  # serves until the process is stopped


if __name__ == "__main__":
    main()
