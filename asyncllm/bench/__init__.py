"""`asyncllm bench`: the standard workloads of docs/benchmarks.md, with transformers as the peer.

One module per workload (throughput, latency, serve, loop_lag, kernels), the
model presets and synthetic requests they share, the decode memory-bandwidth
roofline, the transformers peer and the report. Nothing here is imported by
the engine.
"""
