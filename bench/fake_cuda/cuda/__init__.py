"""A fake `cuda` package for the randomized schedules of backend `cuda` (bench/fake_cuda)."""
