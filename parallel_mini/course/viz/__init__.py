"""Altair chart builders: written once, used by the lessons and by the app.

Every function takes plain data (a `collectives.ring_experiment` dict, `collectives.primitives_demo`
rows, a `RunReport.to_dict()`, or rows of plain dicts) and returns an Altair chart. Nothing here
launches ranks or touches torch.distributed: what is drawn is exactly what the run measured, with
the prediction of `theory` (as carried in the data) beside it.

One module per topic, each listing its charts in its docstring:

    ring.py      the collectives and the ring all-reduce        (lesson 01, Ring all-reduce page)
    links.py     this machine's links: time vs size, the α–β fit, beside NVLink, PCIe, InfiniBand
                                                                  (lesson 01, This machine's links page)
    run.py       one training run: loss, bytes, memory, timeline (lesson 02, Data parallel page)
    memory.py    memory per GPU by ZeRO stage, activations, disk I/O (lesson 03, Memory page)
    tensor.py    tensor and sequence parallel                    (lesson 04, Tensor parallel page)
    pipeline.py  pipeline schedules, the bubble, memory in flight (lesson 05, Pipeline page)
    context.py   context parallel: the K/V ring, tile maps, Ulysses, activations vs s
                                                                  (lesson 06, Long sequences page)
    experts.py   routing, the all-to-all matrix, expert load     (lesson 07, Experts page)
    plan.py      the planner's layouts and the toy's memory       (lessons 08-09, Plan a run page)
    barrier.py   staleness, loss against the wall clock, local SGD's bytes, FedAvg rounds
                                                                  (lesson 10, Without a barrier page)
    animate.py   frames drawn in the browser by the chart's own timer (Ring, Long sequences)
    style.py     fitting a chart to its container, presentation sizes
    units.py     what they share: units, autosize, grouped bars by source

The charts of lessons 01-06 are also here, so `viz.loss_curves(report)` works without knowing its
module; the experts' and the planner's are imported from `viz.experts` and `viz.plan`.
"""
import sys


def _jsonschema_without_iri_formats() -> None:
    """Altair validates every chart with jsonschema, which, where rfc3987_syntax is installed
    (JupyterLab brings it, through jsonschema[format-nongpl]), imports it to check the "iri" and
    "iri-reference" formats, and rfc3987_syntax compiles a Lark grammar as it is imported: ~1.2 s
    of CPU in every process that draws a chart (each lesson's kernel, the app's server) for two
    formats the Vega-Lite schema never uses (its formats: color-hex, uri, uri-reference). So
    jsonschema is imported first here with rfc3987_syntax hidden, as where it is not installed;
    the package is importable again afterwards, for anyone who asks for it."""
    if "jsonschema" in sys.modules or "rfc3987_syntax" in sys.modules:
        return
    sys.modules["rfc3987_syntax"] = None  # `import rfc3987_syntax` raises ImportError
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        pass
    finally:
        if "rfc3987_syntax" in sys.modules and sys.modules["rfc3987_syntax"] is None:
            del sys.modules["rfc3987_syntax"]


_jsonschema_without_iri_formats()

from .context import (BLOCK_COLORS, CP_COMM_COLORS, CP_COMM_KINDS, SKIPPED_COLOR,
                      cp_activation_curve, cp_bytes_chart, cp_comm_frame, cp_comm_timeline,
                      cp_ranks, cp_sent_bytes, cp_work_bars, cp_work_theory_bars, ring_kv_animation,
                      ring_kv_frames, tile_map, tile_map_frame, tile_maps, tiles_theory)
from .memory import (DISK_COLOR, HOST_COLOR, STAGE_CATEGORIES, STAGE_COLORS, activation_bars,
                     disk_io_bars, disk_io_rows,
                     memory_measured_vs_theory, memory_measured_vs_theory_frame, memory_stages,
                     memory_stages_frame)
from .pipeline import (PIPE_COLORS, PIPE_KINDS, bubble_bars, in_flight_chart, in_flight_frame,
                       pipeline_frame, pipeline_stage_bars, pipeline_timeline)
from .ring import (PHASE_COLORS, bandwidth_bars, primitives_frame, primitives_table, ranks_label,
                   ring_animation, ring_frames_frame, ring_moves_text, ring_step_times,
                   ring_time_bars)
from .run import (KIND_COLORS, KIND_ORDER, MEMORY_COLORS, MEMORY_ORDER, comm_bytes,
                  comm_bytes_frame, loss_curves, memory_bars, memory_frame, timeline,
                  timeline_frame)
from .tensor import (TP_ACTIVATION_SOURCES, TP_COMM_COLORS, TP_COMM_KINDS, tp_activation_bars,
                     tp_comm_by_layer, tp_comm_frame, tp_link_times, tp_weight_shards,
                     tp_weight_shards_frame, weight_shard_cells)
from .units import (ACTIVATION_COLORS, ACTIVATION_SOURCES, PAD, bars_by_source, bytes_unit,
                    decimal_bytes_unit, rate_unit, time_unit)
