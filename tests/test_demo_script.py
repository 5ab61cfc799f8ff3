"""scripts/demo.sh (`make demo`) writes plain text into a log (issue 39)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_headings_have_no_escape_codes_in_a_log(tmp_path):
    """Regression: demo.sh wrote raw \\033[1m escapes into logs. Each gradstat call is
    `true` here: only the script's own output is checked."""
    env = {**os.environ, "GRADSTAT": "true", "OUT": str(tmp_path / "demo")}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "== capture:" in result.stdout and "== report:" in result.stdout
    assert "\x1b" not in result.stdout + result.stderr
