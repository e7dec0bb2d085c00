"""cpu_features: ISA flags and the AMX tile request, which must never raise."""

from __future__ import annotations

import ctypes
import logging

from pagoda import cpu_features
from pagoda.cpu_features import AmxStatus, isa_report, request_amx_status, request_amx_tiles


def test_isa_report_names_every_flag_of_interest():
    report = isa_report(frozenset({"avx512_bf16", "sse2"}))
    assert set(report) == set(cpu_features.ISA_FLAGS)
    assert report["avx512_bf16"] and not report["amx_tile"]


def test_no_amx_flag_means_no_request(monkeypatch):
    def forbidden(*_args):
        raise AssertionError("arch_prctl must not be called without amx_tile")

    monkeypatch.setattr(cpu_features, "_arch_prctl", forbidden)
    status = request_amx_status(frozenset({"avx512f"}))
    assert status == AmxStatus(False, "not requested: the CPU does not list amx_tile")


def test_this_machine_gets_a_clear_status_and_never_raises():
    status = request_amx_tiles()
    assert isinstance(status, AmxStatus) and status.reason
    if "amx_tile" not in cpu_features.cpu_info()[1]:
        assert not status.usable and "amx_tile" in status.reason
    assert request_amx_tiles() is status  # once per process


def test_a_refusal_is_a_status_not_an_exception(monkeypatch):
    monkeypatch.setattr(cpu_features, "_already_permitted", lambda: False)
    monkeypatch.setattr(cpu_features, "_arch_prctl", lambda code, arg: (-1, 22))
    status = request_amx_status(frozenset({"amx_tile"}))
    assert not status.usable
    assert status.reason.startswith("refused") and "errno 22" in status.reason


def test_a_grant_is_usable(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_features, "_already_permitted", lambda: False)
    monkeypatch.setattr(cpu_features, "_arch_prctl",
                        lambda code, arg: calls.append((code, arg.value)) or (0, 0))
    status = request_amx_status(frozenset({"amx_tile"}))
    assert status.usable
    assert calls == [(0x1023, 18)]


def test_the_real_syscall_with_a_faked_flag_does_not_crash():
    # NOTE: where the CPU has no AMX the kernel refuses (EOPNOTSUPP or EINVAL); where it
    # has, it grants. Either way a status comes back.
    status = request_amx_status(frozenset({"amx_tile"}))
    has_amx = "amx_tile" in cpu_features.cpu_info()[1]
    assert status.usable == has_amx or status.reason.startswith("refused")


def test_missing_libc_syscall_is_a_status(monkeypatch):
    def broken(*_args):
        raise OSError("no libc")

    monkeypatch.setattr(cpu_features, "_already_permitted", broken)
    status = request_amx_status(frozenset({"amx_tile"}))
    assert not status.usable and "no syscall" in status.reason


def test_refusal_logged_once(monkeypatch, caplog):
    request_amx_tiles.cache_clear()
    monkeypatch.setattr(cpu_features, "request_amx_status",
                        lambda: AmxStatus(False, "refused by the kernel: test"))
    with caplog.at_level(logging.WARNING, logger="pagoda.cpu_features"):
        request_amx_tiles()
        request_amx_tiles()
    request_amx_tiles.cache_clear()
    assert [r.getMessage() for r in caplog.records] == ["AMX tiles refused by the kernel: test"]


def test_the_permission_query_is_harmless():
    perm = ctypes.c_ulong(0)
    ret, _ = cpu_features._arch_prctl(0x1022, ctypes.byref(perm))
    assert ret in (0, -1)


def test_the_worker_requests_amx_before_it_builds_the_model(tiny_model, monkeypatch):
    from pagoda import LLM
    from pagoda.worker import worker as worker_mod

    order = []
    build = worker_mod.build_model
    monkeypatch.setattr(worker_mod, "request_amx_tiles",
                        lambda: order.append("amx") or AmxStatus(False, "test"))
    monkeypatch.setattr(worker_mod, "build_model",
                        lambda *a, **k: order.append("build") or build(*a, **k))
    LLM(model=str(tiny_model("LlamaForCausalLM")), max_model_len=64)
    assert order == ["amx", "build"]
