"""Re-predict a saved `bench plan` run with whichever planner PYTHONPATH imports (this checkout,
or an older commit's `git archive` copy): predicted / measured step time per layout, how many
within 0.7-1.4, Spearman. The measured step times are the run's; only the prediction changes.

    PYTHONPATH=. python docs/plan-shared-cores/repredict.py HW.json PLAN.json
"""
import dataclasses
import json
import sys

from parallel_mini.course import planner as P

hw_json, plan_json = sys.argv[1], sys.argv[2]
fields = {f.name for f in dataclasses.fields(P.Hardware)}  # an older planner knows fewer
hw = P.Hardware(**{k: v for k, v in json.load(open(hw_json))["hardware"].items() if k in fields})
res = json.load(open(plan_json))
res = res.get("plan", res)
model = dict(P.VALIDATION_MODEL)
batch = model.pop("batch")
spec = P.toy_model(batch=batch, **model)
pred, meas = [], []
for row in res["rows"]:
    if "error" in row:
        print(f"{row['layout']:<50} failed: {row['error'][:80]}")
        continue
    p = P.predict(spec, P.Layout(**row["fields"]), hw, batch, precision="fp32")
    pred.append(p["step_s"])
    meas.append(row["measured_step_s"])
    comm = " ".join(f"{a} {1e3 * c['exposed_s']:.0f}" for a, c in p["comm"].items())
    print(f"{row['layout']:<50} predicted {1e3 * p['step_s']:6.0f} ms, measured "
          f"{1e3 * row['measured_step_s']:6.0f} ms, ratio {p['step_s'] / row['measured_step_s']:.2f}"
          f" (compute {1e3 * p['compute_s']:.0f}, comm {comm})")
inside = sum(0.7 <= a / b <= 1.4 for a, b in zip(pred, meas))
print(f"within 0.7-1.4: {inside} of {len(pred)}; Spearman {P.spearman(pred, meas):+.2f}")
