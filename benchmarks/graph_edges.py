"""What kind of dependency each CUDA graph the engine captures puts between its kernels.

    python benchmarks/graph_edges.py [--json OUT] -- <decode_batch.py arguments>

A kernel launched with programmatic dependent launch (PDL, `kiln.kernels.launch`) and captured
into a CUDA graph gets a *programmatic* edge from the kernel before it: it may start while that
one still runs. A *default* edge makes it wait for its predecessor's completion and a launch
after it, ~0.3 us more per hand-off on an H100. The forty-second pass saw whole graph replays
hand off at +0.42 us a kernel instead of +0.10 (the sampled DFlash verify graph, MTP's chain
graph), fast or slow as a whole; this tool reads the captured graphs' edges to tell whether such
a graph lost its programmatic edges at capture or keeps them and is slow on the GPU.

It runs `decode_batch.py` in this process with every graph the engine captures
(`CudaGraphCapturer.capture`) kept (`torch.cuda.CUDAGraph(keep_graph=True)`), reads each graph's nodes
and edges through the CUDA driver (`cuGraphGetEdges_v2`: an edge's type and ports), and prints one
line per graph, in capture order: where it was captured (the kiln frames of the stack and their
`bs` / `q` locals), its kernel nodes, its other nodes, and its kernel-to-kernel edges by type,
with the first default ones named. The graph is then instantiated as the engine would on its
first replay, so the decode that follows runs as usual (its `--trace` too).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import functools
import inspect
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# CUgraphNodeType; CUgraphDependencyType
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}
EDGE_TYPES = {0: "default", 1: "programmatic"}


def summarize(types: list[str], names: list[str], edges: list[tuple[int, int, int, int]]) -> dict:
    """One graph's shape from its node types and names (by node index) and its edges (from, to,
    type, from_port): node counts by type, kernel-to-kernel edges by type and port, how many
    nodes join several predecessors, and the first default kernel-to-kernel edges by name."""
    kinds = collections.Counter(types)
    kk = collections.Counter()
    default_pairs = []
    indegree = collections.Counter()
    for a, b, etype, port in edges:
        indegree[b] += 1
        if types[a] == types[b] == "kernel":
            kk[f"{EDGE_TYPES.get(etype, etype)}/port{port}"] += 1
            if etype == 0:
                default_pairs.append(f"{names[a]} -> {names[b]}")
    return {"nodes": dict(kinds), "kernel_edges": dict(kk), "joins": sum(1 for v in indegree.values() if v > 1),
            "roots": sum(1 for i in range(len(types)) if indegree[i] == 0),
            "first_default": default_pairs[:6], "default_successors": dict(collections.Counter(
                p.split(" -> ")[1] for p in default_pairs).most_common(8))}


class _Driver:
    """The few CUDA driver calls that read a graph's topology (libcuda through ctypes)."""

    class EdgeData(ctypes.Structure):
        _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                    ("reserved", ctypes.c_ubyte * 5)]

    class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
        _fields_ = [("func", ctypes.c_void_p)] + [(n, ctypes.c_uint) for n in (
            "gx", "gy", "gz", "bx", "by", "bz", "smem")] + [
            ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
            ("ctx", ctypes.c_void_p)]

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _ok(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")

    def nodes(self, graph: int) -> list[int]:
        n = ctypes.c_size_t(0)
        self._ok(self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
        arr = (ctypes.c_void_p * n.value)()
        self._ok(self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
        return [int(x or 0) for x in arr]

    def node_type(self, node: int) -> str:
        t = ctypes.c_int(-1)
        self._ok(self.lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        return NODE_TYPES.get(t.value, str(t.value))

    def kernel_name(self, node: int) -> str:
        p = self.KernelParams()
        if self.lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)) != 0:
            return "?"
        name = ctypes.c_char_p()
        if p.func and self.lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func)) == 0 and name.value:
            return name.value.decode()[:60]
        if p.kern and self.lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(p.kern)) == 0 and name.value:
            return name.value.decode()[:60]
        return "?"

    def edges(self, graph: int) -> list[tuple[int, int, int, int]]:
        fn = self.lib.cuGraphGetEdges_v2
        n = ctypes.c_size_t(0)
        self._ok(fn(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges_v2")
        frm, to = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
        data = (self.EdgeData * n.value)()
        self._ok(fn(ctypes.c_void_p(graph), frm, to, data, ctypes.byref(n)), "cuGraphGetEdges_v2")
        return [(int(frm[i]), int(to[i]), data[i].type, data[i].from_port) for i in range(n.value)]


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver:
    """Opened at the first capture: a CPU run captures nothing and has no libcuda."""
    return _Driver()


def _where() -> str:
    """The kiln frames above the capture (innermost first) with their `bs` / `q` locals."""
    parts = []
    for f in inspect.stack(0)[2:]:
        if f"{os.sep}kiln{os.sep}" not in f.filename or f.filename.endswith("cuda_graph.py") and f.function == "capture":
            continue
        shape = {k: f.frame.f_locals[k] for k in ("bs", "q") if isinstance(f.frame.f_locals.get(k), int)}
        parts.append(f"{os.path.basename(f.filename)}:{f.function}" + (f"{shape}" if shape else ""))
        if len(parts) == 3:
            break
    return " < ".join(parts)


@contextlib.contextmanager
def kept_graphs(records: list):
    """Inside the block, every graph the engine captures is kept and its summary appended to
    `records`; torch's CUDAGraph and the capturer are restored after."""
    import torch

    from kiln.engine import cuda_graph

    original = torch.cuda.CUDAGraph

    class KeptGraph(original):
        def __new__(cls, keep_graph: bool = True):
            return original.__new__(cls, True)

        def __init__(self, keep_graph: bool = True):
            super().__init__(keep_graph=True)

    torch.cuda.CUDAGraph = KeptGraph
    capture = cuda_graph.CudaGraphCapturer.capture

    def capture_and_read(self, fn):
        replay, out = capture(self, fn)
        graph = replay.__self__
        record = {"index": len(records), "where": _where()}
        try:
            driver = _driver()
            nodes = driver.nodes(graph.raw_cuda_graph())
            index = {n: i for i, n in enumerate(nodes)}
            types = [driver.node_type(n) for n in nodes]
            names = [driver.kernel_name(n) if t == "kernel" else t for n, t in zip(nodes, types)]
            edges = [(index[a], index[b], t, p) for a, b, t, p in driver.edges(graph.raw_cuda_graph())]
            record.update(summarize(types, names, edges))
        except Exception as e:  # the decode still runs: the summary says what failed
            record["error"] = repr(e)
        graph.instantiate()
        records.append(record)
        print(f"[graph {record['index']}] {record['where']}: nodes {record.get('nodes')} kernel edges "
              f"{record.get('kernel_edges')} joins {record.get('joins')} roots {record.get('roots')}"
              + (f" error {record['error']}" if "error" in record else ""), flush=True)
        if record.get("first_default"):
            print(f"    default edges into: {record['default_successors']}; first: {record['first_default']}",
                  flush=True)
        return replay, out

    cuda_graph.CudaGraphCapturer.capture = capture_and_read
    try:
        yield records
    finally:
        cuda_graph.CudaGraphCapturer.capture = capture
        torch.cuda.CUDAGraph = original


def main(argv: Optional[list[str]] = None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the graphs' summaries here")
    args = parser.parse_args(argv[:split])
    import decode_batch

    with kept_graphs([]) as records:
        decode_batch.main(argv[split + 1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
