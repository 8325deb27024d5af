"""Child names: every one fits its owner's limit for every admitted name and attempt."""

from __future__ import annotations

import re

import pytest
from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.api.validation import check_name, validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.render import build_raycluster

DNS1035 = re.compile(constants.DNS1035_PATTERN)
SPEC = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}}
# Every attempt up to 1,000, then the boundaries of each decimal width up to 10^6 and the
# wrap of the fixed-width base-36 tag.
ATTEMPTS = [*range(1, 1001), *(10**k + d for k in range(3, 7) for d in (-1, 0, 1)),
            36**5 - 1, 36**5]  # fmt: skip


def test_max_name_length_is_derived_from_every_child() -> None:
    assert constants.MAX_NAME_LENGTH == min(
        47 - len("-j00001"),  # RayJob: KubeRay's limit
        53 - len("-abcde"),  # RayCluster: KubeRay's limit
        63 - len("-abcde-head-svc"),  # KubeRay's head Service, a DNS label
        63 - len("-api"),  # the API Service, a DNS label
    ) == 40


@pytest.mark.parametrize("length", range(1, constants.MAX_NAME_LENGTH + 1))
def test_every_child_name_fits_at_every_length_and_attempt(length: int) -> None:
    instance = ("q" + "7b-dp8" * 10)[:length].rstrip("-") or "q"
    instance = instance + "x" * (length - len(instance))
    assert len(instance) == length and check_name(instance) == []
    spec = validate(instance, SPEC)
    cluster = build_raycluster(instance, "ns", spec, build_plan(spec), RenderOptions(), None)
    cluster_name = cluster["metadata"]["name"]
    assert len(cluster_name) <= constants.KUBERAY_MAX_RAYCLUSTER_NAME
    assert DNS1035.fullmatch(cluster_name)
    for child in (names.head_service(cluster_name), names.service(instance)):
        assert len(child) <= constants.DNS_LABEL_MAX and DNS1035.fullmatch(child), child
    for attempt in ATTEMPTS:
        job = names.head_job(instance, attempt)
        assert len(job) <= constants.KUBERAY_MAX_RAYJOB_NAME, (job, attempt)
        assert DNS1035.fullmatch(job), job


def test_head_job_names_have_a_fixed_width_and_never_repeat_up_to_a_million() -> None:
    # The tag reads back as the attempt (so two attempts never share a name) at a fixed width:
    # every attempt to 20,000, then a sample stride up to 10^6 and the last one.
    for attempt in [*range(1, 20_001), *range(20_001, 10**6, 97), 10**6]:
        tag = names.attempt_tag(attempt)
        assert len(tag) == 5 and int(tag, 36) == attempt, (attempt, tag)
    assert names.head_job("demo", 1) == "demo-j00001"
    assert names.head_job("demo", 36) == "demo-j00010"
    assert names.head_job("demo", 10**6) == "demo-j0lfls"


def test_a_forty_character_name_at_attempt_a_million_fits_kuberay() -> None:
    # Before: "<40 chars>-launch-1" was 49 characters, past KubeRay's 47 at the first launch.
    name = "a" * 40
    assert len(names.head_job(name, 1)) == len(names.head_job(name, 10**6)) == 47
