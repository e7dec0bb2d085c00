"""`pagoda bench omp-policy`: each setting's child environment, the aggregation and the
table, with the child runs replaced (the real ones take minutes)."""

from __future__ import annotations

import argparse

import pytest

from pagoda.benchmarks import omp_policy
from pagoda.entrypoints.cli import build_parser


def test_child_env_replaces_the_policy_variables(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = omp_policy.child_env("active")
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in env
    env = omp_policy.child_env("spin-30k")
    assert env["GOMP_SPINCOUNT"] == "30000" and "OMP_WAIT_POLICY" not in env


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "omp-policy", *argv])


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown settings"):
        omp_policy.run_omp_policy(_args("--settings", "spin-3000,turbo"))


def test_rounds_interleave_settings_and_loads(monkeypatch, capsys):
    calls = []

    def fake_child(setting, args):
        calls.append(setting)
        return {"single_ms_per_token": 10.0 + len(calls), "single_median_ms": 10.0,
                "batch_tokens_per_s": 100.0, "batch_median_step_ms": 5.0}

    spinners = []

    class FakeSpinner:
        def kill(self):
            spinners.append("killed")

        def wait(self):
            pass

    monkeypatch.setattr(omp_policy, "_run_child", fake_child)
    monkeypatch.setattr(omp_policy, "_spinner", FakeSpinner)
    report = omp_policy.run_omp_policy(_args("--settings", "spin-3000,active", "--rounds", "2"))
    assert calls == ["spin-3000", "active"] * 4
    assert spinners == ["killed", "killed"]
    assert set(report["results"]) == {"none / spin-3000", "none / active",
                                      "spin / spin-3000", "spin / active"}
    # medians of the two rounds: calls 1 and 5 -> 11 and 15
    assert report["results"]["none / spin-3000"]["single_ms_per_token"] == 13.0
    out = capsys.readouterr().out
    assert "1-stream ms/tok" in out and "spin / active" in out


def test_a_failed_child_is_reported_not_raised(monkeypatch, capsys):
    monkeypatch.setattr(omp_policy, "_run_child", lambda s, a: {"error": "exit 1: boom"})
    report = omp_policy.run_omp_policy(_args("--settings", "passive", "--load", "none",
                                             "--rounds", "1"))
    assert report["results"]["none / passive"] == {"error": "exit 1: boom"}
    assert "exit 1: boom" in capsys.readouterr().out


def test_fixed_setting_turns_the_adaptive_team_off(monkeypatch):
    monkeypatch.setenv("PAGODA_OMP_ADAPT", "0")
    assert "PAGODA_OMP_ADAPT" not in omp_policy.child_env("spin-3000")
    env = omp_policy.child_env("spin-3000-fixed")
    assert env["PAGODA_OMP_ADAPT"] == "0" and env["GOMP_SPINCOUNT"] == "3000"


def test_omp_load_runs_in_a_session_of_its_own(monkeypatch):
    import os

    job = omp_policy._omp_job()
    try:
        assert os.getsid(job.pid) == job.pid != os.getsid(0)
        assert job.poll() is None
    finally:
        job.kill()
        job.wait()
    calls = []
    monkeypatch.setattr(omp_policy, "_run_child",
                        lambda setting, args: calls.append(setting) or {"error": "skipped"})
    jobs = []

    class FakeJob:
        def kill(self):
            jobs.append("killed")

        def wait(self):
            pass

    monkeypatch.setattr(omp_policy, "_omp_job", FakeJob)
    report = omp_policy.run_omp_policy(_args("--settings", "spin-3000", "--load", "omp",
                                             "--rounds", "1"))
    assert calls == ["spin-3000"] and jobs == ["killed"]
    assert set(report["results"]) == {"omp / spin-3000"}
