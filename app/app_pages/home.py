"""Home: what the app is, how to use it in class, which pages exist."""
import streamlit as st

st.title("parallel_mini: distributed training, measured live")
st.markdown("""
Every page of this app starts **real processes** (one per rank, talking over gloo on this
machine's CPU), runs the algorithm, and draws **what the ranks measured** beside **what the
formula predicts** (`parallel_mini.theory`). Nothing on the charts is simulated: the ring
animation is decoded from the messages the ranks really sent, the bytes are counted by the
communication layer, the memory by the meters.

**In class**

1. Project this app (`make app`, then open http://127.0.0.1:8501) and turn on **Presentation
   mode** in the sidebar: chart text of 16 px or more, charts as wide as the page, each page's
   controls and its **Run live** button in the sidebar beside the chart. The settings of every page
   are kept while you move between pages.
2. Ask the room to predict the number first (how many bytes does each rank send? how many steps?).
3. Move the sliders, press **Run live**; in about a second the run is done and the measured value
   appears next to the formula. Change one knob and run again.
4. The same charts appear in the lessons (`make lab`), where learners write the code themselves.

Results are cached per setting, so going back to a setting already run is instant. Tick
*Fresh measurement* to take the timings again.

**Pages**

- **Ring all-reduce**: how N ranks sum a tensor by passing chunks around a ring: 2(N−1) steps,
  2(N−1)/N·X bytes sent by each rank, and the bandwidth that makes it fast.
- **Data parallel**: a tiny GPT trained on 1, 2 or 4 ranks, naive or with gradient buckets
  that overlap the all-reduce with the backward pass; the loss equals the single-process
  reference; bytes, memory and a timeline of every op.
- **Memory per GPU**: ZeRO stages 0–3 side by side against a GPU's capacity, from a toy model
  to 405B (theory alone for the big ones); the toys run all four stages live, and the measured
  params, grads and optimizer states equal the formula to the byte.
- **Tensor parallel**: Megatron's column/row split drawn from each rank's real weight shards;
  the tp traffic by layer (all-reduces, or SP's all-gathers and reduce-scatters: the same bytes)
  equal to the formula, activations per layer with and without SP, and why TP stays inside a node.
- **Pipeline bubbles**: naive, GPipe, 1F1B, interleaved and zero-bubble schedules drawn as
  planned, then run on 2 or 4 stages: each rank's step as a timeline (replayed as if each rank had
  its own device, and as measured on the wall clock), the bubble measured beside the formula, the
  activations each stage holds in flight, and the point-to-point bytes per stage.
- **Long sequences**: context parallel, every sequence split over 2 or 4 ranks three ways (ring,
  zigzag, Ulysses): the K/V blocks going round the ring animated from the sends the ranks
  recorded, each rank's causal tile map (contiguous beside zigzag, masked tiles skipped), the
  ring's sends beside Ulysses' all-to-alls against the formula, and activation bytes per layer vs
  sequence length, measured points on the formula's curves.

On 2 CPU cores the ranks share the cores, so wall-clock times are stretched by the OS scheduler;
the byte counts and the losses are exact whatever the machine.
""")
