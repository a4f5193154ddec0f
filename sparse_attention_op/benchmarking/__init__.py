"""Measuring the op: clocks (GPU timestamps, host spans), a host-speed probe, and the sweep
behind ``sparse-attention-op bench``. It stands on the runtime wings and on ``testing``.
"""
