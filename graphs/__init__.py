"""rtattn.graphs: explicit driver-API CUDA graphs (capture / instantiate / update / replay)
for the decode wrapper, and the graph-replay demos (python -m rtattn.graphs.demo_*)."""
from .graph import Graph, GraphCaptureError, GraphExec, KernelNode, UpdateResult, capturable_stream, capture
from .decode_graphs import DecodeGraphs, config_key
from .step_graph import StepGraph

__all__ = ["capture", "capturable_stream", "Graph", "GraphExec", "KernelNode", "UpdateResult",
           "GraphCaptureError", "DecodeGraphs", "config_key", "StepGraph"]
