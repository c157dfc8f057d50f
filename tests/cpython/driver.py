# Runs CPython regression tests in this interpreter, one JSON line per test on
# stdout. The same code runs on the host (python3 -c) and inside a forkbox
# sandbox (an exec), so that the two results differ only by where they ran.
# scripts/cpython-tests prepends `PARAMS = {...}`:
#   names: unittest names under `test.` ("test_json", "test_threading.ThreadTests",
#          or full test ids "test.test_os.FileTests.test_access")
#   skip:  test ids not to run (already run, or the one that hung a previous attempt)
# Each line is `\x1eFBT {json}`: {"start": id}, {"id", "o", "msg"} with o one of
# pass, fail, error, skip, xfail, xpass and "t" its seconds; {"load_error": msg}; and {"done": secs} last.
import io as _io
import json as _json
import os as _os
import sys as _sys
import tempfile as _tempfile
import time as _time
import traceback as _traceback
import unittest as _unittest


def _fbt_main(params):
    import test.support as support

    out = _sys.stdout
    t0 = _time.monotonic()

    def emit(rec):
        out.write("\x1eFBT " + _json.dumps(rec) + "\n")
        out.flush()

    # As regrtest without -u and -v: no optional resources, quiet tests.
    support.use_resources = []
    support.verbose = 0
    support.failfast = False
    skip = set(params.get("skip", []))

    def last_line(text):
        lines = [l for l in text.strip().splitlines() if l.strip()]
        return (lines[-1] if lines else "")[:300]

    class Result(_unittest.TestResult):
        def __init__(self):
            super().__init__()
            self._sub = {}

        def startTest(self, test):
            super().startTest(test)
            self._t = _time.monotonic()
            emit({"start": test.id()})

        def secs(self):
            return round(_time.monotonic() - getattr(self, "_t", _time.monotonic()), 3)

        def _put(self, test, outcome, err=None):
            msg = ""
            if err is not None:
                try:
                    msg = last_line("".join(_traceback.format_exception(*err)))
                except Exception as e:  # a broken exception object
                    msg = "unformattable %s: %r" % (type(err[1]).__name__, e)
            emit({"id": test.id(), "o": outcome, "msg": msg, "t": self.secs()})

        def addSuccess(self, test):
            super().addSuccess(test)
            sub = self._sub.pop(test.id(), None)
            if sub:
                emit({"id": test.id(), "o": "fail", "msg": "subtest: " + sub, "t": self.secs()})
            else:
                self._put(test, "pass")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._sub.pop(test.id(), None)
            self._put(test, "fail", err)

        def addError(self, test, err):
            super().addError(test, err)
            self._sub.pop(test.id(), None)
            self._put(test, "error", err)

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            emit({"id": test.id(), "o": "skip", "msg": str(reason)[:300], "t": self.secs()})

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self._put(test, "xfail")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._put(test, "xpass")

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None and test.id() not in self._sub:
                try:
                    line = last_line("".join(_traceback.format_exception(*err)))
                except Exception:
                    line = type(err[1]).__name__
                self._sub[test.id()] = "%s: %s" % (subtest._subDescription(), line)

    def flatten(suite):
        for t in suite:
            if isinstance(t, _unittest.TestSuite):
                yield from flatten(t)
            else:
                yield t

    result = Result()

    def run_suite(suite):
        tests = [t for t in flatten(suite) if t.id() not in skip]
        _unittest.TestSuite(tests).run(result)

    # Modules that still have a test_main() run through support.run_unittest.
    support._run_suite = run_suite

    work = _tempfile.mkdtemp(prefix="cpytests-")
    _os.chdir(work)
    sink = open(_os.devnull, "w", encoding="utf-8")
    saved = _sys.stdout, _sys.stderr
    loader = _unittest.TestLoader()
    try:
        _sys.stdout = _sys.stderr = sink
        for name in params["names"]:
            full = name if name.startswith("test.") else "test." + name
            try:
                parts = full.split(".")
                mod = None
                if len(parts) == 2:
                    import importlib

                    mod = importlib.import_module(full)
                if mod is not None and hasattr(mod, "test_main") and not hasattr(mod, "load_tests"):
                    mod.test_main()
                else:
                    run_suite(loader.loadTestsFromName(full))
            except BaseException as e:  # an import error, SystemExit from test_main, ...
                if isinstance(e, KeyboardInterrupt):
                    raise
                emit({"load_error": "%s: %s" % (name, last_line("".join(_traceback.format_exception(e))))})
    finally:
        _sys.stdout, _sys.stderr = saved
        sink.close()
    emit({"done": round(_time.monotonic() - t0, 3)})


_fbt_main(PARAMS)  # noqa: F821 (prepended by scripts/cpython-tests)
