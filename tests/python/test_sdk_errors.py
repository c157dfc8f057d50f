"""Error classes: every API error code maps to its exception (pure), and the quota
and rate-limit errors are raised by a real server for keys with such limits."""

import time

import httpx
import pytest

import forkbox
from forkbox import Forkbox
from forkbox._errors import _BY_CODE, _BY_STATUS, STATUS_OF_CODE, ForkboxError, ServerError, error_from


@pytest.mark.parametrize("code, cls", [
    ("malformed_json", forkbox.InvalidRequest), ("invalid_request", forkbox.InvalidRequest),
    ("invalid_path", forkbox.InvalidPath), ("unauthorized", forkbox.Unauthorized),
    ("quota_exceeded", forkbox.QuotaExceeded), ("session_not_found", forkbox.SessionNotFound),
    ("checkpoint_not_found", forkbox.CheckpointNotFound), ("file_not_found", forkbox.FileNotFound),
    ("timeout", forkbox.Timeout), ("session_busy", forkbox.SessionBusy),
    ("payload_too_large", forkbox.PayloadTooLarge), ("code_too_large", forkbox.PayloadTooLarge),
    ("file_too_large", forkbox.PayloadTooLarge), ("guest_crashed", forkbox.GuestError),
    ("guest_killed", forkbox.GuestError), ("interrupted", forkbox.GuestError), ("deadlock", forkbox.GuestError),
    ("rate_limited", forkbox.RateLimited), ("overloaded", forkbox.Overloaded),
    ("storage_unavailable", forkbox.StorageUnavailable), ("insufficient_storage", forkbox.InsufficientStorage),
    ("package_not_allowed", forkbox.PackageNotAllowed), ("package_not_found", forkbox.PackageNotFound),
    ("package_conflict", forkbox.PackageConflict), ("package_needs_build", forkbox.PackageNeedsBuild),
    ("package_failed", forkbox.PackageFailed), ("sandbox_crashed", forkbox.SandboxCrashed),
    ("session_moved", forkbox.SessionMoved),
])
def test_codes_map_to_classes(code, cls):
    e = error_from(STATUS_OF_CODE[code], {"error": {"code": code, "message": "m"}})
    assert type(e) is cls and isinstance(e, forkbox.ForkboxError)
    assert (e.code, e.message) == (code, "m")
    # Without a status (an error event of a stream), the status comes from the code.
    assert error_from(0, {"error": {"code": code, "message": "m"}}).status == STATUS_OF_CODE[code]


def test_sdk_code_table_matches_the_servers_openapi_enum(server):
    """The SDK's tables name exactly the codes of the server's one table (the `ErrorCode`
    schema of its OpenAPI document), each with the status the server sends it with."""
    doc = httpx.get(f"{server.url}/v1/openapi.json", timeout=30).json()
    schema = doc["components"]["schemas"]["ErrorCode"]
    codes = schema["x-codes"]
    assert sorted(schema["enum"]) == sorted(codes), "enum and x-codes disagree"
    assert {c: v["status"] for c, v in codes.items()} == STATUS_OF_CODE
    assert set(_BY_CODE) == set(codes), f"SDK classes for unknown codes {set(_BY_CODE) - set(codes)}, missing {set(codes) - set(_BY_CODE)}"
    for code, v in codes.items():
        assert v["description"], code
        cls = _BY_CODE[code]
        # The class chosen by the code agrees with the one the status alone would choose.
        assert issubclass(cls, _BY_STATUS.get(v["status"], ServerError if v["status"] >= 500 else ForkboxError)), code
    # Every error response's `code` refers to that schema.
    detail = doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]
    assert detail.get("$ref", "").endswith("/ErrorCode"), detail


def test_unknown_codes_fall_back_on_the_status():
    assert type(error_from(500, {"error": {"code": "storage_error", "message": "x"}})) is forkbox.ServerError
    assert type(error_from(404, {"error": {"code": "something_new", "message": "x"}})) is forkbox.NotFound
    assert type(error_from(502, "<html>bad gateway</html>")) is forkbox.ServerError
    e = error_from(429, {"error": {"code": "rate_limited", "message": "slow down"}}, retry_after="2")
    assert e.retry_after == 2.0


def test_quota_exceeded_for_sessions(server):
    key = server.create_key("sdk-quota", "--max-sessions", "1")
    with Forkbox(server.url, key) as fb:
        s = fb.sessions.create()
        with pytest.raises(forkbox.QuotaExceeded) as e:
            fb.sessions.create()
        assert (e.value.status, e.value.code) == (403, "quota_exceeded")
        s.delete()
        fb.sessions.create().delete()  # room again


def test_rate_limited(server):
    key = server.create_key("sdk-rate", "--rate-limit", "2")
    with Forkbox(server.url, key) as fb:
        with pytest.raises(forkbox.RateLimited) as e:
            for _ in range(20):
                fb.sessions.list()
        assert e.value.status == 429 and e.value.retry_after is not None and e.value.retry_after >= 1
        time.sleep(e.value.retry_after)
        fb.sessions.list()
