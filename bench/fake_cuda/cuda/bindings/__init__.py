"""The fake `cuda.bindings`: only `driver` (bench/fake_cuda/cuda/bindings/driver.py)."""
