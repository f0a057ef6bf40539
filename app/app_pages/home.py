"""Home: what the app is, how to use it in class, every page in one line, and the default runs
the server measured when it started."""
import streamlit as st

import live_runs

st.title("parallel_mini: distributed training, measured live")
st.markdown("""
Every page of this app starts **real processes** (one per rank, talking over gloo on this
machine's CPU), runs the algorithm, and draws **what the ranks measured** beside **what the
formula predicts** (`parallel_mini.theory`). The ring animation is decoded from the messages the
ranks really sent, the bytes are counted by the communication layer, the memory by the meters.

**In class**

1. Project this app (`make app` prints its address) and turn on **Presentation mode** in the
   sidebar: chart text of 16 px or more, each page's controls and its **Run live** button in the
   sidebar beside the chart. The settings of every page are kept while you move between pages.
2. Ask the room to predict the number first (how many bytes does each rank send? how many steps?).
3. Move the sliders, press **Run live**: the ranks run, and the measured value appears next to
   the formula. The status line under the button says whether the result was **measured now**
   (and how long it took) or **taken from the cache** (and when it was measured).
4. The same charts appear in the lessons (`make lab`), where learners write the code themselves.

Every page's default setting is measured once, in the background, when the server's first visitor
opens the app, and every result is shared
by everyone watching: a whole class pressing **Run live** at the same setting reads one result, and
presses of the same new setting at once join one run. Tick *Fresh measurement* to measure again.

**Pages**

- **Ring all-reduce**: N ranks sum a tensor around a ring, animated from the messages they sent:
  2(N−1) steps, 2(N−1)/N·X bytes each.
- **This machine's links**: point-to-point and the four collectives timed over message sizes, the
  latency α and bandwidth B fitted, one all-reduce here beside NVLink, PCIe and InfiniBand.
- **Data parallel**: a tiny GPT on 1, 2 or 4 ranks, naive or bucketed all-reduce, equal to one
  process; bytes, memory, a timeline of every op.
- **Memory per GPU**: ZeRO stages 0–3 (with TP and PP) against a GPU's capacity, up to 405B in
  theory; the toys measured equal to the formula to the byte.
- **Tensor parallel**: Megatron's column/row split from each rank's real shards, the tp traffic by
  layer against the formula, activations with and without SP.
- **Pipeline bubbles**: naive, GPipe, 1F1B, interleaved and zero-bubble schedules run on 2 or 4
  stages: timelines, the bubble measured beside the formula.
- **Long sequences**: context parallel (ring, zigzag, Ulysses) on 2 or 4 ranks: K/V blocks going
  round, causal tile maps, bytes and activations against the formula.
- **Experts**: a mixture of experts on 2 or 4 ranks: the all-to-all that routes tokens, expert load
  and drops, the aux loss that balances them.
- **Without a barrier**: a straggler against synchronous DP and asynchronous SGD on 4 ranks (the
  staleness histogram, loss against the wall clock), local SGD's bytes per sample, federated
  averaging on non-IID clients.
- **Plan a run**: a model and a cluster in, the planner's ranked layouts and the decision guide
  out, the toy version of the chosen layout run live.

On 2 CPU cores the ranks share the cores, so wall-clock times are stretched by the OS scheduler;
the byte counts and the losses are exact whatever the machine.
""")

states = live_runs.warm_states()
if states:
    st.markdown("**Default runs, measured as the server started**")
    st.markdown("\n".join(f"- {title}: {state}" for title, state in states.items()))
