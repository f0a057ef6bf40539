"""Presentation mode, kept controls, readable units and refused custom models (AppTest, no runs):
the sidebar toggle moves a page's controls and its "Run live" button to the sidebar and draws every
chart with text >= 16 px; controls keep their values when you leave a page and come back; a
disabled SP box is unticked; sizes read "TB", never "e+04 GB"; a custom model whose heads do not
divide its hidden size is refused with the reason. The browser side (computed font sizes, the
first screen) is in test_browser_presentation.py."""
from __future__ import annotations

import altair as alt
import pandas as pd

from parallel_mini.course.viz.style import presentation, scaled_font
from test_app import _app, _assert_clean, _chart, _charts, _widget

MEMORY = "app_pages/memory.py"
FONT_KEYS = ("fontSize", "labelFontSize", "titleFontSize", "subtitleFontSize")


def _font_sizes(spec) -> list[float]:
    """Every font size a spec sets, explicit or in its config."""
    found = []
    if isinstance(spec, dict):
        for key, value in spec.items():
            if key in FONT_KEYS and isinstance(value, (int, float)):
                found.append(value)
            elif key not in ("datasets", "data"):
                found += _font_sizes(value)
    elif isinstance(spec, list):
        for item in spec:
            found += _font_sizes(item)
    return found


def test_presentation_style_raises_every_font_and_widens_panels():
    df = pd.DataFrame({"x": ["a", "b"], "y": [1, 2]})
    bars = alt.Chart(df).mark_bar().encode(
        x=alt.X("x:N", axis=alt.Axis(labelFontSize=9)), y="y:Q").properties(width=200, height=100)
    label = alt.Chart(df).mark_text(fontSize=8).encode(x="x:N", y="y:Q", text="y:Q")
    panel = alt.layer(bars, label).properties(title=alt.TitleParams("t", fontSize=12))
    spec = presentation(alt.hconcat(panel, panel), width_px=1000)
    sizes = _font_sizes(spec)
    assert min(sizes) >= 16 and scaled_font(12) > scaled_font(10) == 16  # order kept
    # what a chart leaves to Vega-Lite's defaults (10-13 px) is set in the config
    assert spec["config"]["axis"]["labelFontSize"] >= 16 and spec["config"]["text"]["fontSize"] >= 16
    widths = [p["width"] for p in spec["hconcat"]]  # Altair lifts a layer's size to the layer
    assert widths[0] == widths[1] > 200 and sum(widths) <= 1000
    assert spec["hconcat"][0]["height"] == 100  # heights kept: one screen


def test_presentation_mode_moves_controls_to_the_sidebar_and_enlarges_chart_text():
    at = _app(MEMORY)
    assert not at.sidebar.button  # normal mode: controls and "Run live" on the page
    normal = _font_sizes(_chart(at, "Memory per GPU by ZeRO stage")["spec"])
    assert min(normal) < 16
    _widget(at.toggle, "Presentation mode").set_value(True).run()
    _assert_clean(at)
    assert [b.label for b in at.sidebar.button] == ["Run live"]
    assert _widget(at.sidebar.radio, "ZeRO stage").value == 0
    spec = _chart(at, "Memory per GPU by ZeRO stage")["spec"]
    assert min(_font_sizes(spec)) >= 16
    # the toggle is kept on the next page
    at.switch_page("app_pages/ring.py").run()
    assert _widget(at.toggle, "Presentation mode").value is True
    assert [b.label for b in at.sidebar.button] == ["Run live"]


def test_controls_keep_their_values_across_page_changes():
    at = _app(MEMORY)
    _widget(at.radio, "Tensor parallel degree").set_value(2).run()
    _widget(at.checkbox, "Sequence parallel").check().run()
    _widget(at.select_slider, "GPUs").set_value(8).run()
    at.switch_page("app_pages/ring.py").run()
    _widget(at.slider, "World size").set_value(6).run()
    at.switch_page("app_pages/home.py").run()
    at.switch_page(MEMORY).run()
    _assert_clean(at)
    assert _widget(at.radio, "Tensor parallel degree").value == 2
    assert _widget(at.checkbox, "Sequence parallel").value is True
    assert _widget(at.select_slider, "GPUs").value == 8
    at.switch_page("app_pages/ring.py").run()
    assert _widget(at.slider, "World size").value == 6


def test_sp_is_unticked_when_tp_goes_back_to_one():
    at = _app(MEMORY)
    _widget(at.radio, "Tensor parallel degree").set_value(2).run()
    _widget(at.checkbox, "Sequence parallel").check().run()
    assert "(SP)" in " ".join(_chart(at, "Memory per GPU by ZeRO stage")["spec"]["title"]["subtitle"])
    _widget(at.radio, "Tensor parallel degree").set_value(1).run()
    sp = _widget(at.checkbox, "Sequence parallel")
    assert sp.disabled and sp.value is False
    _widget(at.radio, "Tensor parallel degree").set_value(2).run()
    assert _widget(at.checkbox, "Sequence parallel").value is False  # not ticked again behind it


def test_big_sizes_read_in_tb_not_exponents():
    at = _app(MEMORY)
    _widget(at.selectbox, "Model").set_value("405B").run()
    _widget(at.select_slider, "GPUs").set_value(1).run()
    _assert_clean(at)
    zero0 = _widget(at.metric, "ZeRO-0 model states").value
    # 405e9 parameters x 16 bytes (bf16 + Adam's fp32 states) = 6.48e12 B on one GPU
    assert zero0.endswith(" TB") and "e+" not in zero0, zero0
    texts = [m.value for m in at.metric] + [m.value for m in at.markdown]
    assert not any("e+" in t for t in texts), [t for t in texts if "e+" in t]


def test_a_custom_model_with_impossible_heads_is_refused_with_the_reason():
    at = _app(MEMORY)
    _widget(at.selectbox, "Model").set_value("custom size (billions of parameters)").run()
    _assert_clean(at)  # the default custom model (13B, 40 x 5120, 40 heads) is fine
    _widget(at.number_input, "Hidden size").set_value(64).run()
    _widget(at.number_input, "Attention heads").set_value(512).run()
    assert len(at.error) == 1 and "not divisible by 512 attention heads" in at.error[0].value
    assert not _charts(at)  # nothing drawn from an impossible model
    assert _widget(at.number_input, "Attention heads").value == 512  # the input is kept
    _widget(at.number_input, "Attention heads").set_value(4).run()
    _widget(at.number_input, "Layers").set_value(40).run()
    _assert_clean(at)
    _widget(at.number_input, "Hidden size").set_value(65536).run()  # 12 x 40 x 65536^2 >> 13B
    assert len(at.error) == 1 and "12·L·h² = 2,062B parameters" in at.error[0].value


def test_other_dependent_controls_reset_when_disabled():
    at = _app("app_pages/tensor.py")
    _widget(at.radio, "Data-parallel replicas").set_value(2).run()
    _widget(at.checkbox, "Sequence parallel").check().run()
    _widget(at.radio, "Tensor-parallel degree").set_value(4).run()  # dp greys out: back to 1
    assert _widget(at.radio, "Data-parallel replicas").value == 1
    _widget(at.radio, "Tensor-parallel degree").set_value(1).run()  # SP greys out: unticked
    assert _widget(at.checkbox, "Sequence parallel").value is False
    at.switch_page("app_pages/data_parallel.py").run()
    _widget(at.select_slider, "Bucket size").set_value(1.0).run()
    _widget(at.radio, "Gradient sync").set_value("naive").run()
    bucket = _widget(at.select_slider, "Bucket size")
    assert bucket.disabled and bucket.value == 0.25  # the default again, not 1.0 behind the grey
    _assert_clean(at)
