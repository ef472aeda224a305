"""The Helm chart charts/rlkube, rendered with the pinned helm (no cluster): lint, the objects it
makes with default values and with every optional part on, RBAC exactly as operator/README.md
lists it, the CRD copy kept current, and dashboards and alert rules that only use series the
runtime and the operator really export (alert rules also pass `promtool check rules`).

helm comes from tests/controlplane/build.sh (CI always runs it first); promtool from Debian's
prometheus package, which the same script installs. Missing binaries fail the tests, naming the
command to run.

tests/integration/test_chart.py imports the helpers below (render, dashboard_queries, ...).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlkube"
CRD = REPO / "crds" / "rlkube.io_rljobs.yaml"
CRD_COPY = CHART / "crds" / "rlkube.io_rljobs.yaml"
REFRESH_CRD = "cp crds/rlkube.io_rljobs.yaml charts/rlkube/crds/"

CONTROLPLANE_DIR = REPO / "tests" / "controlplane"
if str(CONTROLPLANE_DIR) not in sys.path:
    sys.path.insert(0, str(CONTROLPLANE_DIR))
from harness import BUILD_COMMAND, cache_dir
from rlkube_runtime.spec.contract import IMAGE_UID

# Every optional part on (monitors, rules, dashboards), cluster-wide.
ALL_ON = ["serviceMonitor.enabled=true", "podMonitor.enabled=true", "prometheusRule.enabled=true",
          "grafanaDashboards.enabled=true", "trainerImage=reg/trainer:1", "rolloutImage=reg/rollout:1"]
# One watched namespace, kopf peering on.
NAMESPACED = ["watchNamespace=team-a", "operator.standalone=false"]

METRIC_NAME = re.compile(r"\b(?:rlkube_[a-z_]+|sglang:[a-z_]+)")


# --- helpers (also used by tests/integration/test_chart.py) --------------------------------------


def helm_bin() -> Path:
    helm = cache_dir() / "bin" / "helm"
    if not helm.is_file():
        pytest.fail(f"helm is missing at {helm}: run `{BUILD_COMMAND}` (CI always builds it first)", pytrace=False)
    return helm


def promtool_bin() -> str:
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if promtool is None:
        pytest.fail(f"promtool is missing: run `{BUILD_COMMAND}` (it installs Debian's prometheus package)",
                    pytrace=False)
    return promtool


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm_bin()), *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
    return proc


def render(*sets: str, namespace: str = "rlkube-system") -> list[dict]:
    """`helm template rlkube charts/rlkube --set ...`, parsed (the CRD included, as install applies it)."""
    args = ["template", "rlkube", str(CHART), "--namespace", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind} objects rendered"
    return found[0]


def dashboard_configmaps(docs: list[dict]) -> list[dict]:
    return [cm for cm in by_kind(docs, "ConfigMap") if "grafana_dashboard" in cm["metadata"]["labels"]]


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title or variable, PromQL) for every panel target and query variable."""
    out = []
    for file, dash in dashboards().items():
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append((file, panel["title"], target["expr"]))
        for var in dash.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                out.append((file, f"variable {var['name']}", query))
    return out


def for_prometheus(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard query as Prometheus' API takes it: Grafana's variables filled in (every RLJob), and
    a variable's `label_values(series, label)` as the PromQL that has data when it has values."""
    expr = re.sub(r"^label_values\((.+), *(\w+)\)$", r"count by (\2) (\1)", expr.strip())
    return expr.replace("$__rate_interval", rate_interval).replace("$rljob", ".+")


def rule_groups(docs: list[dict]) -> list[dict]:
    return one(docs, "PrometheusRule")["spec"]["groups"]


def exported_series() -> tuple[set[str], set[str]]:
    """(runtime series, operator series) under the names Prometheus stores them."""
    from prometheus_client import Counter, Gauge, Histogram
    from rlkube_operator import metrics as operator_metrics
    from rlkube_runtime.engine.metrics import SGLANG_SERIES
    from rlkube_runtime.serving.engine_metrics import ENGINE_METRICS_UP
    from rlkube_runtime.metrics import ENGINE_RESTARTS, EVAL_GAUGES, EVAL_PASS_AT_K, PROMETHEUS_GAUGES

    runtime = {s.name for s in (*PROMETHEUS_GAUGES.values(), *EVAL_GAUGES.values(), ENGINE_RESTARTS, EVAL_PASS_AT_K)}
    runtime |= {*SGLANG_SERIES, ENGINE_METRICS_UP}  # the engines' own, passed through the driver
    operator = set()
    for collector in vars(operator_metrics).values():
        if isinstance(collector, Counter):
            operator.add(collector._name + "_total")  # prometheus_client strips and re-adds _total
        elif isinstance(collector, Histogram):
            operator.update(collector._name + suffix for suffix in ("_bucket", "_sum", "_count"))
        elif isinstance(collector, Gauge):
            operator.add(collector._name)
    return runtime, operator


def series_in(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


# --- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [[], ALL_ON, ALL_ON + NAMESPACED], ids=["defaults", "all-on", "namespaced"])
def test_helm_lint_passes(sets):
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    helm(*args)


def test_the_chart_ships_a_current_copy_of_the_crd():
    assert CRD_COPY.exists(), f"charts/rlkube/crds has no CRD: run `{REFRESH_CRD}`"
    assert CRD_COPY.read_bytes() == CRD.read_bytes(), (
        f"charts/rlkube/crds/rlkube.io_rljobs.yaml differs from crds/rlkube.io_rljobs.yaml: run `{REFRESH_CRD}`"
    )


def test_defaults_install_the_crd_rbac_admission_policies_operator_metrics_service_and_dashboards_only():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                            "Deployment", "Service", "ConfigMap", "ConfigMap", "ConfigMap",
                            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy",
                            "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"]), kinds
    assert {d["metadata"]["labels"]["grafana_dashboard"] for d in dashboard_configmaps(docs)} == {"1"}


def test_all_optional_parts_render_as_prometheus_operator_objects():
    docs = render(*ALL_ON)
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert one(docs, kind)["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(docs, "Service")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    pod_monitor = one(docs, "PodMonitor")
    # The labels the operator puts on every RLJob's Ray head pod (rlkube_operator.render).
    from rlkube_operator.render import LABEL_MANAGED_BY, LABEL_ROLE, MANAGED_BY

    assert pod_monitor["spec"]["selector"]["matchLabels"] == {LABEL_MANAGED_BY: MANAGED_BY, LABEL_ROLE: "head"}


def test_the_deployment_runs_one_nonroot_operator_with_probes_and_a_metrics_port():
    deployment = one(render(*ALL_ON), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "rlkube"
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Service links would turn the Service rlkube-metrics into RLKUBE_METRICS_PORT=tcp://... (found on a real node).
    assert pod["enableServiceLinks"] is False
    (container,) = pod["containers"]
    assert container["image"] == "rlkube/operator:0.1.0" and container["imagePullPolicy"] == "IfNotPresent"
    assert container["command"] + container["args"] == ["rlkube", "operator", "--metrics-port=8080", "--standalone"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RLKUBE_LIVENESS_ENDPOINT"] == "http://0.0.0.0:8081/healthz"
    assert env["RLKUBE_TRAINER_IMAGE"] == "reg/trainer:1" and env["RLKUBE_ROLLOUT_IMAGE"] == "reg/rollout:1"


def test_a_watched_namespace_is_passed_and_scheduling_values_reach_the_pod():
    docs = render("watchNamespace=team-a", "nodeSelector.pool=system", "tolerations[0].key=dedicated",
                  "tolerations[0].operator=Exists", "image.tag=dev", "image.pullPolicy=Always")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--namespace=team-a" in container["args"]
    assert container["image"] == "rlkube/operator:dev" and container["imagePullPolicy"] == "Always"
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]


# operator/README.md, "Permissions the operator needs": (apiGroup, resource) -> verbs.
NAMESPACED_GRANTS = {
    ("rlkube.io", "rljobs"): {"get", "list", "watch", "delete"},
    ("rlkube.io", "rljobs/status"): {"get", "patch"},
    ("ray.io", "rayjobs"): {"list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "serviceaccounts"): {"get", "create"},
    ("", "secrets"): {"create"},
    ("", "pods"): {"list"},
    ("", "events"): {"create"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "create"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create"},
    ("networking.k8s.io", "networkpolicies"): {"create"},
}
KOPF_CLUSTER_GRANTS = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}
PEERING = {"get", "list", "watch", "patch"}


def grants(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in out, f"{group}/{resource} granted twice"
                out[(group, resource)] = set(rule["verbs"])
    return out


def test_cluster_wide_rbac_grants_exactly_the_readme_permissions():
    docs = render()
    assert grants(one(docs, "ClusterRole")["rules"]) == NAMESPACED_GRANTS | KOPF_CLUSTER_GRANTS
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rlkube", "namespace": "rlkube-system"}]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")


def test_one_watched_namespace_gets_a_role_and_kopf_keeps_its_cluster_reads_and_peering():
    docs = render(*NAMESPACED)
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert grants(role["rules"]) == NAMESPACED_GRANTS | {("kopf.dev", "kopfpeerings"): PEERING}
    assert grants(one(docs, "ClusterRole")["rules"]) == KOPF_CLUSTER_GRANTS | {("kopf.dev", "clusterkopfpeerings"): PEERING}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_dashboards_cover_every_exported_series_and_use_no_other():
    runtime, operator = exported_series()
    used: set[str] = set()
    for file, where, expr in dashboard_queries():
        names = series_in(expr)
        assert names, f"{file} {where}: no rlkube_ series in {expr!r}"
        unknown = names - runtime - operator
        assert not unknown, f"{file} {where}: {sorted(unknown)} are not exported (query {expr!r})"
        used |= names
    operator_families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in operator}
    used_families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert runtime <= used, f"no panel shows {sorted(runtime - used)}"
    assert operator_families <= used_families, f"no panel shows {sorted(operator_families - used_families)}"


def test_dashboard_configmaps_carry_the_json_files_unchanged():
    docs = render()
    shipped = {}
    for cm in dashboard_configmaps(docs):
        shipped.update(cm["data"])
    assert {k: json.loads(v) for k, v in shipped.items()} == dashboards()
    for dash in dashboards().values():
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in dash["panels"])


def test_alert_rules_use_only_exported_series_and_pass_promtool(tmp_path):
    runtime, operator = exported_series()
    groups = rule_groups(render("prometheusRule.enabled=true", "prometheusRule.checkpointMaxAgeMinutes=30"))
    alerts = {r["alert"]: r["expr"] for g in groups for r in g["rules"]}
    assert {"RLJobFailed", "RLJobRestartsIncreasing", "RlkubeOperatorReconcileErrors", "RLJobCheckpointStale",
            "RLJobRewardFlat", "RLJobStalled", "RLJobEngineRestarts"} <= alerts.keys()
    assert alerts["RLJobCheckpointStale"] == "time() - rlkube_last_checkpoint_timestamp_seconds > 1800"
    for alert, expr in alerts.items():
        names = series_in(expr)
        assert names and not names - runtime - operator, f"{alert}: {sorted(names - runtime - operator)} not exported"
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    proc = subprocess.run([promtool_bin(), "check", "rules", str(rules)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts)} rules found" in proc.stdout, proc.stdout


def run_promtool_rule_tests(tmp_path: Path, groups: list[dict], cases: list[dict]) -> None:
    """promtool's rule unit tests (`promtool test rules`) of the rendered alert `groups`: each case
    is one test block (interval, input_series, alert_rule_test), evaluated every minute."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": cases}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    proc = subprocess.run([promtool_bin(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_checkpoint_and_reward_alerts_fire_on_synthetic_series(tmp_path):
    """promtool's rule unit tests: a checkpoint 40 minutes old fires RLJobCheckpointStale (30 min
    limit); a reward stuck at 0.5 while rollouts advance fires RLJobRewardFlat, a moving one does not."""
    groups = rule_groups(render("prometheusRule.enabled=true", "prometheusRule.checkpointMaxAgeMinutes=30",
                                "prometheusRule.rewardFlatWindow=10m"))
    run_promtool_rule_tests(tmp_path, groups, [{
        "interval": "1m",
        "input_series": [
            # Checkpoint written at t=0 (unix 0), never again.
            {"series": 'rlkube_last_checkpoint_timestamp_seconds{rljob="a"}', "values": "0x60"},
            {"series": 'rlkube_rollout_id{rljob="flat"}', "values": "0+1x60"},
            {"series": 'rlkube_reward_mean{rljob="flat"}', "values": "0.5x60"},
            {"series": 'rlkube_rollout_id{rljob="learning"}', "values": "0+1x60"},
            {"series": 'rlkube_reward_mean{rljob="learning"}', "values": "0+0.01x60"},
        ],
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": "RLJobCheckpointStale", "exp_alerts": []},
            {"eval_time": "40m", "alertname": "RLJobCheckpointStale",
             "exp_alerts": [{"exp_labels": {"severity": "warning", "rljob": "a"},
                             "exp_annotations": {"summary": "RLJob a has no checkpoint newer than 30 minutes."}}]},
            {"eval_time": "30m", "alertname": "RLJobRewardFlat",
             "exp_alerts": [{"exp_labels": {"severity": "warning", "rljob": "flat"},
                             "exp_annotations": {"summary": "RLJob flat: mean reward unchanged for 10m while "
                                                            "rollouts finished."}}]},
        ],
    }])


def test_restart_alert_counts_failures_not_preemptions(tmp_path):
    """promtool's rule unit tests: three restarts after preemptions in an hour (spot nodes being
    reclaimed) leave RLJobRestartsIncreasing quiet; two after failures fire it."""
    groups = rule_groups(render("prometheusRule.enabled=true"))
    run_promtool_rule_tests(tmp_path, groups, [{
        "interval": "1m",
        "input_series": [
            {"series": 'rlkube_operator_job_restarts_total{reason="preemption"}', "values": "0 0 1x10 2x10 3x40"},
            {"series": 'rlkube_operator_job_restarts_total{reason="failure"}', "values": "0x60"},
        ],
        "alert_rule_test": [{"eval_time": "40m", "alertname": "RLJobRestartsIncreasing", "exp_alerts": []}],
    }, {
        "interval": "1m",
        "input_series": [
            {"series": 'rlkube_operator_job_restarts_total{reason="preemption"}', "values": "0x60"},
            {"series": 'rlkube_operator_job_restarts_total{reason="failure"}', "values": "0 0 1x10 2x40"},
        ],
        "alert_rule_test": [{"eval_time": "40m", "alertname": "RLJobRestartsIncreasing",
                             "exp_alerts": [{"exp_labels": {"severity": "warning", "reason": "failure"},
                                             "exp_annotations": {"summary": "RLJob attempts were restarted 2 "
                                                                            "times in the last hour."}}]}],
    }])


# --- the admission policies and the operator's pod policy ------------------------------------------


def _policy(docs: list[dict], suffix: str) -> dict:
    [policy] = [d for d in by_kind(docs, "ValidatingAdmissionPolicy") if d["metadata"]["name"].endswith(suffix)]
    return policy


def _variable(policy: dict, name: str) -> str:
    return next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == name)


def test_the_admission_policy_refuses_the_sglang_and_router_flags_the_spec_refuses():
    # The CEL map literal of flag -> what sets it, read back with Python's own literal parser.
    import ast

    from rlkube_runtime.spec.rollout import _SGLANG_FLAG_ALIASES, MANAGED_ROUTER_FLAGS, MANAGED_SGLANG_FLAGS

    policy = _policy(render(), "-rljob-reach")
    sglang = ast.literal_eval(_variable(policy, "managedSglangFlags"))
    router = ast.literal_eval(_variable(policy, "managedRouterFlags"))
    aliases = {alias: MANAGED_SGLANG_FLAGS[flag] for alias, flag in _SGLANG_FLAG_ALIASES.items()}
    assert sglang == {**MANAGED_SGLANG_FLAGS, **aliases}
    assert router == MANAGED_ROUTER_FLAGS


def test_the_runtime_status_policy_leaves_the_runtime_exactly_its_own_fields():
    import ast

    from rlkube_runtime.spec.contract import RUNTIME_STATUS_FIELDS

    policy = _policy(render(), "-runtime-status")
    fields = ast.literal_eval(_variable(policy, "runtimeFields"))
    # restarts is shared: the policy lets the runtime change restarts.engine only.
    assert sorted(fields) == sorted({f.split(".")[0] for f in RUNTIME_STATUS_FIELDS})
    assert [f for f in RUNTIME_STATUS_FIELDS if "." in f] == ["restarts.engine"]
    match = policy["spec"]["matchConditions"][0]["expression"]
    assert "'-runtime'" in match and "system:serviceaccount:" in match


def test_the_operator_reads_the_same_pod_policy_the_admission_policy_enforces(tmp_path):
    from rlkube_runtime.spec.pod_policy import load_pod_policy

    sets = ["podPolicy.default.volumeTypes={nfs}", "podPolicy.namespaces.team-a.secretNames={hf}",
            "podPolicy.namespaces.team-a.imageRegistries={reg.example.com/a/}"]
    docs = render(*sets)
    [configmap] = [cm for cm in by_kind(docs, "ConfigMap") if cm["metadata"]["name"].endswith("-pod-policy")]
    path = tmp_path / "pod-policy.yaml"
    path.write_text(configmap["data"]["pod-policy.yaml"])
    policy = load_pod_policy(path)
    team_a, other = policy.allowance("team-a"), policy.allowance("other")
    # A namespace's entry replaces the default's value of each field it sets, and keeps the rest.
    assert (team_a.volume_types, team_a.secret_names, team_a.image_registries) == (["nfs"], ["hf"], ["reg.example.com/a/"])
    assert (other.volume_types, other.secret_names, other.image_registries) == (["nfs"], [], [])
    # The admission policy's literal says the same.
    allowance = _variable(_policy(docs, "-rljob-reach"), "allowance")
    assert ('{"team-a":{"imageRegistries":["reg.example.com/a/"],"secretNames":["hf"],"volumeTypes":["nfs"]}}'
            in allowance)
    assert allowance.endswith('{"imageRegistries":[],"secretNames":[],"volumeTypes":["nfs"]}')
    deployment = one(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLKUBE_POD_POLICY"] == "/etc/rlkube-operator/pod-policy.yaml"


def test_the_network_policy_peers_of_the_values_are_the_operators_defaults():
    from rlkube_operator.settings import OperatorSettings

    deployment = one(render(), "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    env.pop("RLKUBE_POD_POLICY")  # a file in the pod (test_the_operator_reads_the_same_pod_policy_...)
    settings = OperatorSettings.from_env(env)
    assert settings.metrics_from == OperatorSettings().metrics_from
    assert settings.dashboard_from == OperatorSettings().dashboard_from
    assert (settings.run_as_user, settings.read_only_root_filesystem) == (IMAGE_UID, True)
