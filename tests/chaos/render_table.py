"""The chaos suite's figures (tests/chaos/.results/figures.json, written by the scenarios) as the
Markdown table of tests/chaos/README.md.

    python tests/chaos/render_table.py            # print the table
    python tests/chaos/render_table.py --write    # replace the table in tests/chaos/README.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIGURES_FILE = HERE / ".results" / "figures.json"
README = HERE / "README.md"
START, END = "<!-- chaos-table:start -->", "<!-- chaos-table:end -->"

# Table order; a scenario missing from the figures is shown as not run.
SCENARIOS = (
    "control: uninterrupted rerun",
    "engine SIGKILL mid-rollout",
    "engine SIGKILL mid-weight-sync",
    "trainer SIGKILL mid-step -> resume",
    "driver SIGKILL mid-step -> resume",
    "driver SIGTERM mid-rollout -> checkpoint -> resume",
    "head pod deleted on a real node -> preStop, SIGTERM -> preemption -> next attempt",
    "corrupt + half-written latest checkpoints -> newest intact one",
    "disk full during a save -> clear error -> resume",
    "operator SIGKILL mid-reconcile -> restart",
    "kube-apiserver restart -> watch recovers, new RLJob reconciled",
)
HEADER = ("scenario", "groups lost", "groups trained twice", "samples, versions, weights = reference",
          "rollouts redone", "recovery", "other figures")
# Figures shown in their own columns (the rest go under "other figures").
SHOWN = {"groups_lost", "groups_trained_twice", "samples_lost", "samples_trained_twice", "samples_as_reference",
         "weight_versions_as_reference", "weights_as_reference", "rollouts_redone", "measured_at",
         "engine_serving_again_s", "attempt_training_again_s", "operator_reconciled_all_s",
         "new_rljob_reconciled_after_s", "next_attempt_training_s"}
RECOVERY = (
    ("engine_serving_again_s", "engine serving again {} s after the kill"),
    ("attempt_training_again_s", "new attempt training again {} s after its start"),
    ("operator_reconciled_all_s", "all RLJobs reconciled {} s after the operator's restart"),
    ("new_rljob_reconciled_after_s", "new RLJob reconciled {} s after the API server was back"),
    ("next_attempt_training_s", "next attempt training again {} s after the head pod's deletion"),
)


def render(figures: dict[str, Any]) -> str:
    scenarios = figures.get("scenarios", {})
    rows = [HEADER, ("---",) * len(HEADER)]
    for name in (*SCENARIOS, *sorted(set(scenarios) - set(SCENARIOS))):
        f = scenarios.get(name)
        if f is None:
            rows.append((name, "not run", "", "", "", "", ""))
            continue
        rows.append((
            name,
            _count(f, "groups_lost", "samples_lost"),
            _count(f, "groups_trained_twice", "samples_trained_twice"),
            _same(f),
            str(f.get("rollouts_redone", "n/a")),
            "; ".join(text.format(f[key]) for key, text in RECOVERY if key in f) or "n/a",
            ", ".join(f"{k}={_plain(v)}" for k, v in sorted(f.items()) if k not in SHOWN),
        ))
    times = sorted(f["measured_at"] for f in scenarios.values() if "measured_at" in f)
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    span = f"Measured {times[0]} to {times[-1]} (UTC)." if times else "No figures yet."
    return f"{table}\n\n{span}"


def _count(f: dict[str, Any], groups: str, samples: str) -> str:
    if groups not in f:
        return "n/a"
    return f"{f[groups]} ({f.get(samples, 'n/a')} samples)"


def _same(f: dict[str, Any]) -> str:
    keys = ("samples_as_reference", "weight_versions_as_reference", "weights_as_reference")
    if not any(k in f for k in keys):
        return "n/a"
    return "yes" if all(f.get(k) is True for k in keys) else "NO: " + ", ".join(k for k in keys if f.get(k) is not True)


def _plain(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def write_readme(table: str, readme: Path = README) -> None:
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", type=Path, default=FIGURES_FILE)
    parser.add_argument("--write", action="store_true", help=f"replace the table in {README}")
    args = parser.parse_args(argv)
    if not args.figures.exists():
        print(f"no figures at {args.figures}: run `pytest tests/chaos` first", file=sys.stderr)
        return 1
    table = render(json.loads(args.figures.read_text()))
    if args.write:
        write_readme(table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
