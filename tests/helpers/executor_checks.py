"""Runs a check script of tests/executor/ in a process of its own (the SIMT executor becomes
the backend of the whole process that loads it) and returns the JSON it prints."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def run_check(script: str, timeout: int) -> dict:
    """the JSON a check script of tests/executor/ prints, run in a process of its own (the
    executor's library loaded there only)"""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "executor", script), ROOT],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
