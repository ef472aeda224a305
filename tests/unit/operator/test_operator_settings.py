"""Operator-wide settings from the environment."""

from __future__ import annotations

import pytest
from rlkube_operator.settings import OperatorSettings
from rlkube_runtime.spec.contract import IMAGE_UID
from rlkube_runtime import __version__


def test_defaults_name_the_project_images_of_this_version():
    s = OperatorSettings.from_env({})
    assert s.trainer_image == f"rlkube/trainer:{__version__}"
    assert s.rollout_image == f"rlkube/rollout:{__version__}"
    assert (s.max_backoff_seconds, s.resync_seconds) == (300.0, 30.0)


def test_environment_overrides():
    s = OperatorSettings.from_env({"RLKUBE_TRAINER_IMAGE": "t:1", "RLKUBE_ROLLOUT_IMAGE": "r:1",
                                   "RLKUBE_MAX_BACKOFF_SECONDS": "5", "RLKUBE_RESYNC_SECONDS": "0.5"})
    assert (s.trainer_image, s.rollout_image, s.max_backoff_seconds, s.resync_seconds) == ("t:1", "r:1", 5.0, 0.5)


@pytest.mark.parametrize("value", ["soon", "0", "-1"])
def test_bad_durations_name_the_variable_and_value(value):
    with pytest.raises(ValueError, match=rf"RLKUBE_RESYNC_SECONDS must be .*{value!r}"):
        OperatorSettings.from_env({"RLKUBE_RESYNC_SECONDS": value})


def test_pods_run_as_the_images_user_on_a_read_only_root_unless_the_environment_says_otherwise():
    assert (OperatorSettings.from_env({}).run_as_user, OperatorSettings.from_env({}).read_only_root_filesystem) == (
        IMAGE_UID, True)
    s = OperatorSettings.from_env({"RLKUBE_RUN_AS_USER": "2000", "RLKUBE_READ_ONLY_ROOT_FILESYSTEM": "false"})
    assert (s.run_as_user, s.read_only_root_filesystem) == (2000, False)


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("RLKUBE_RUN_AS_USER", "0", "non-root UID"),
    ("RLKUBE_RUN_AS_USER", "root", "non-root UID"),
    ("RLKUBE_READ_ONLY_ROOT_FILESYSTEM", "yes", "true or false"),
])
def test_bad_pod_security_settings_name_the_variable_and_value(key, value, needle):
    with pytest.raises(ValueError, match=rf"{key} must be .*{needle}.*{value!r}"):
        OperatorSettings.from_env({key: value})
