"""Importing the charts (parallel_mini.course.viz) leaves out jsonschema's rfc3987_syntax (a Lark
grammar compiled at import: ~1.2 s of CPU in every lesson kernel and app server), and altair still
validates every chart against the Vega-Lite schema."""
import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None,
                    reason="rfc3987_syntax is not installed here: nothing to leave out")
def test_charts_import_without_rfc3987_syntax():
    """Neither imported nor left hidden (a None in sys.modules): importable by whoever asks."""
    out = subprocess.run([sys.executable, "-c", "import sys, parallel_mini.course.viz\n"
                          "print('rfc3987_syntax' in sys.modules, 'jsonschema' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_charts_are_still_validated():
    import altair as alt

    import parallel_mini.course.viz  # noqa: F401

    alt.Chart({"values": [{"x": 1}]}).mark_point().encode(x="x:Q").to_dict()
    with pytest.raises(alt.utils.schemapi.SchemaValidationError):
        alt.Chart({"values": [{"x": 1}]}).mark_point(size="big").encode(x="x:Q").to_dict()
