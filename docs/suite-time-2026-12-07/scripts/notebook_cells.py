"""Executes one lesson notebook in a fresh kernel and prints each code cell that took over 0.3 s,
and the total. python docs/suite-time-2026-12-07/scripts/notebook_cells.py lessons/solutions/03_memory_and_zero.ipynb"""
import sys
import time

import nbformat
from nbclient import NotebookClient

nb = nbformat.read(sys.argv[1], as_version=4)
client = NotebookClient(nb, timeout=600, kernel_name="python3",
                        resources={"metadata": {"path": "lessons/solutions"}})
t0 = time.time()
with client.setup_kernel():
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        t = time.time()
        client.execute_cell(cell, i)
        if time.time() - t > 0.3:
            print(f"{time.time() - t:6.2f} s  cell {i}: {cell.source[:80]!r}")
print(f"total {time.time() - t0:.1f} s")
