"""`vitrail bench gemm`, found here by vitrail.ops.load_benchmarks: vitrail.gemm.ops.benchmarks
registers it."""
import importlib

importlib.import_module("vitrail.gemm.ops.benchmarks")
